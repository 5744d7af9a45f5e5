#!/usr/bin/env bash
# One device call for issue 16 (the performance table): the CUDA tests first (the non-fused path's
# host decision is new: its sync count and results are checked there), a cost probe of the host
# calls a guarded step makes per parameter and of the memory reading, then issue 16's table
# (every group, one process). Each part bounded.
#   OUT=/tmp/o COMMIT=<c> bash benchmarks/gpu_issue16.sh     (from the repository root)
# SKIP_TESTS=1: the table only (the second, identical run).
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/benchmarks/results/gpu_issue16}"; mkdir -p "$OUT"
start=$(date +%s); log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$OUT/session.txt"; }
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" >> "$OUT/session.txt" 2>&1
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout -k 10 "${TESTS_TIMEOUT:-200}" python3 -m pytest -q tests/gpu -p no:cacheprovider \
        > "$OUT/gpu_tests.txt" 2>&1; log "tests/gpu rc=$?"
    timeout -k 10 60 python3 benchmarks/host_probe.py > "$OUT/host_probe.txt" 2>&1; log "host probe rc=$?"
fi
timeout -k 10 "${TABLE_TIMEOUT:-400}" python3 benchmarks/table.py --device cuda --commit "${COMMIT:-unknown}" \
    --blocks "${BLOCKS:-30}" --budget-s "${TABLE_BUDGET:-360}" --out "$OUT/${RUN:-run}.json" \
    > "$OUT/${RUN:-run}.txt" 2>&1; log "table rc=$?"
