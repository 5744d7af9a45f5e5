set -x
R=/work/main/benchmarks/results/cpu_stop45
for run in 1 2; do
  (cd /work/main && PYTHONPATH=/work/main OMP_NUM_THREADS=1 .venv/bin/python benchmarks/table.py --device cpu --groups mlp-small,mlp --blocks 400 --profile-steps 0 --no-memory --no-syncs --budget-s 400 --commit 4e359e8 --out $R/after_$run.json > $R/after_$run.log 2>&1)
  (cd /tmp/before && PYTHONPATH=/tmp/before OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/table.py --device cpu --groups mlp-small,mlp --blocks 400 --profile-steps 0 --no-memory --no-syncs --budget-s 400 --commit 9161924 --out $R/before_$run.json > $R/before_$run.log 2>&1)
done
echo done
