# Stop 56: the CPU table in float32 (--cpu-autocast off: this host has no bf16 matmul units), the tree before
# (/tmp/before: a worktree at BEFORE) and after (/work/main at AFTER), alternating, two runs each.
# usage: BEFORE=<commit> AFTER=<commit> TAG=<name> bash benchmarks/results/cpu_stop56/tables.sh
set -x
R=/work/main/benchmarks/results/cpu_stop56
GROUPS_=${GROUPS_:-mlp-small}
for run in 1 2; do
  (cd /tmp/before && PYTHONPATH=/tmp/before OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/table.py --device cpu --groups $GROUPS_ --blocks 300 --profile-steps 0 --no-memory --no-syncs --cpu-autocast off --commit $BEFORE --out $R/${TAG}_before_$run.json > $R/${TAG}_before_$run.log 2>&1)
  (cd /work/main && PYTHONPATH=/work/main OMP_NUM_THREADS=1 .venv/bin/python benchmarks/table.py --device cpu --groups $GROUPS_ --blocks 300 --profile-steps 0 --no-memory --no-syncs --cpu-autocast off --commit $AFTER --out $R/${TAG}_after_$run.json > $R/${TAG}_after_$run.log 2>&1)
done
grep -h "guard_.*/ plain" $R/${TAG}_*_?.md
