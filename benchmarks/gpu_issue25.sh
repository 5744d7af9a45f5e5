#!/usr/bin/env bash
# One device call after the architecture merge: the CUDA tests (bitwise vs the plain GradScaler loop, sync
# counts, no hook on healthy steps, resume, two ranks on one GPU), then the per-step cost of the one decision
# rule on CUDA (tensor execution, graph replay, and the host execution after one copy), each part bounded.
#   OUT=/tmp/o bash benchmarks/gpu_issue25.sh        (from the repository root)
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/benchmarks/results/gpu_issue25}"; mkdir -p "$OUT"
start=$(date +%s); log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$OUT/session.txt"; }
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" >> "$OUT/session.txt" 2>&1
timeout -k 10 "${TESTS_TIMEOUT:-300}" python3 -m pytest -q tests/gpu -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1; log "tests/gpu rc=$?"
if [ -f benchmarks/decide_cost.py ]; then
  base=(); [ -d bench_base ] && base=(--base-dir bench_base)  # the base's rule files (the device copy has no git)
  timeout -k 10 "${DECIDE_TIMEOUT:-150}" python3 benchmarks/decide_cost.py "${base[@]}" --runs 1 --steps 1000 \
      > "$OUT/decide_cost_cuda.txt" 2>&1; log "decide_cost rc=$?"
fi
