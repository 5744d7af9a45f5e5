#!/usr/bin/env bash
# One device call for issues 14/16/17 after the issue 17 merges: the CUDA tests, the numerics
# benchmark (cost at numerics_every=10 with the leading indicators, headroom vs default policy over
# 2000 steps), and the sentinel's cost (guard vs guard + sentinel, 30 blocks). Each part bounded.
#   OUT=/tmp/o bash benchmarks/gpu_issue17.sh        (from the repository root)
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/benchmarks/results/gpu_issue17}"; mkdir -p "$OUT"
start=$(date +%s); log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$OUT/session.txt"; }
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" >> "$OUT/session.txt" 2>&1
timeout -k 10 "${TESTS_TIMEOUT:-200}" python3 -m pytest -q tests/gpu -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1; log "tests/gpu rc=$?"
timeout -k 10 "${NUMERICS_TIMEOUT:-200}" python3 benchmarks/numerics.py --device cuda --out "$OUT/numerics" \
    > "$OUT/numerics.txt" 2>&1; log "numerics rc=$?"
timeout -k 10 "${SENTINEL_TIMEOUT:-100}" python3 benchmarks/overhead.py --device cuda \
    --variants guard_fused,guard_sentinel_fused --steps 300 --block 10 --no-extras --out "$OUT/sentinel.json" \
    > "$OUT/sentinel.txt" 2>&1; log "sentinel rc=$?"
