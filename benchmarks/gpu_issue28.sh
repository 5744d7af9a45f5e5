#!/usr/bin/env bash
# Issues 28 and 27 on the H200: the fp8 and integrity GPU tests, the guarded fp8 cost (eager, then compiled), the
# replica digest's variants; FRAMEWORKS=1: issue 26's frameworks benchmark. Run through the device tool with the torchao wheel carried in .whl/:
#   OUT=$OUT bash benchmarks/gpu_issue28.sh TAG
set -uo pipefail
TAG=${1:-now}
pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu_$TAG.txt"
python -c "import torch, torchao; print(torch.__version__, torchao.__version__)" | tee -a "$OUT/gpu_$TAG.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/gpu_$TAG.txt"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_integrity.py 2>&1 \
    | tail -25 | tee "$OUT/tests_$TAG.txt"
fi
if [ "${DIGEST:-1}" = 1 ]; then
  timeout 150 python benchmarks/digest_variants.py --device cuda --model gpt2 --reps 30 --out "$OUT/digest_$TAG.json" 2>&1 \
    | grep -v Warning | tee "$OUT/digest_$TAG.txt"
fi
if [ "${FRAMEWORKS:-0}" = 1 ]; then  # issue 26: the frameworks with their clip folded (Lightning's too, no clip there)
  timeout 230 python benchmarks/frameworks_cost.py --device cuda --frameworks accelerate,transformers,lightning \
    --blocks 20 --budget-s 200 --out "$OUT/frameworks_$TAG.json" 2>&1 | grep -v -i warn | tail -30 \
    | tee "$OUT/frameworks_$TAG.txt"
fi
if [ "${INTEGRITY:-0}" = 1 ]; then
  timeout 170 python benchmarks/integrity_cost.py --device cuda --model gpt2 --blocks 12 --block 8 --reps 20 \
    --out "$OUT/integrity_$TAG.json" 2>&1 | grep -v -i warn | tail -12 | tee "$OUT/integrity_$TAG.txt"
fi
if [ "${PROFILE:-0}" = 1 ]; then  # stop 52: the compiled fp8 step's kernels by name, this tree's library then PROFILE_BASE's
  for side in now ${PROFILE_BASE:-}; do
    root=$PWD
    if [ "$side" != now ]; then
      rm -rf /tmp/pbase && mkdir -p /tmp/pbase && git archive "$side" ampguard benchmarks/fp8_cost.py | tar -x -C /tmp/pbase
      root=/tmp/pbase
    fi
    (cd "$root" && PYTHONPATH=$root:/tmp/site timeout "${PROFILE_S:-200}" python benchmarks/fp8_cost.py --device cuda \
      --compile --batch 32 --blocks 4 --steps 5 --profile-steps 10 --variants plain,guard,guard+fp8-nosample \
      --out "$OUT/profile_${TAG}_$side.json") 2>&1 | grep -v -i "warn\|Configuration class\|loss_type" | tail -45 \
      | tee "$OUT/profile_${TAG}_$side.txt"
  done
fi
for run in ${FP8_RUNS-1 2}; do
  timeout ${FP8_EAGER_S:-170} python benchmarks/fp8_cost.py --device cuda --blocks 30 --steps 5 --out "$OUT/fp8_cost_${TAG}_$run.json" 2>&1 \
    | grep -v -i warn | tail -6 | tee "$OUT/fp8_cost_${TAG}_$run.txt"
done
for run in ${COMPILE_RUNS-1}; do
  # FP8_VARIANTS=plain,plain2,guard,...: a subset (each compiled variant costs ~20 s of compile before its timing)
  # FP8_PROFILE_STEPS=N: after the timing, N steps of each variant under the profiler (its kernel time per step and
  # its ratio to plain's: the device's share, which a noisy lease's wall clock hides; ~40 s more for 8 variants)
  timeout ${FP8_TIMEOUT:-200} python benchmarks/fp8_cost.py --device cuda --blocks ${FP8_BLOCKS:-20} --steps ${FP8_STEPS:-5} --batch ${FP8_BATCH:-8} --compile \
    --profile-steps ${FP8_PROFILE_STEPS:-0} ${FP8_VARIANTS:+--variants $FP8_VARIANTS} --out "$OUT/fp8_cost_${TAG}_compiled_b${FP8_BATCH:-8}_$run.json" 2>&1 | grep -v -i "warn\|Configuration class\|loss_type" | grep -v "^    " | tail -24 \
    | tee "$OUT/fp8_cost_${TAG}_compiled_b${FP8_BATCH:-8}_$run.txt"
done
