#!/usr/bin/env bash
# One GPU session, one command: (a) the CUDA test suite, (b) the framework cost benchmark.
#
#   bash benchmarks/gpu_session.sh            # from the repository root; results in $OUT
#
# $OUT (the device tool's output folder) gets at most 4 files, flat:
#   session.txt           versions, GPU, the exit status and time of each part
#   gpu_tests.txt         python3 -m pytest -q tests/gpu -p no:cacheprovider   (bounded: 210 s)
#   frameworks_cost.json  benchmarks/frameworks_cost.py --device cuda            (bounded: 330 s; it stops
#   frameworks_cost.txt   its own timing at 270 s and keeps the rounds done)
# Worst case about 9 minutes; expected about 4 (CUDA start-up, ~1.5 min of tests, ~2.5 min of benchmark).
# (b) runs whatever (a) returned. Exit status: 0 when both passed, else 1.
#
# Without the pytest-timeout plugin, pyproject's `timeout = 300` only makes pytest warn
# ("Unknown config option: timeout"); the `timeout` command below bounds the run either way.
# A smoke run of this script on a CPU machine:
#   AMPGUARD_GPU_TESTS_ON_CPU=1 BENCH_ARGS="--device cpu --quick" TESTS_TIMEOUT=900 OUT=/tmp/session \
#       bash benchmarks/gpu_session.sh
# (Lightning catches SIGTERM to stop its loop gracefully: a test cut by the timeout shows as a failure
# in Lightning's test, and `timeout -k 10` kills the rest 10 s later.)
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/benchmarks/results/gpu_session}"
mkdir -p "$OUT"
start=$(date +%s)
log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$OUT/session.txt"; }

: > "$OUT/session.txt"
log "git $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed files"
python3 - <<'EOF' 2>&1 | tee -a "$OUT/session.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("accelerate", "transformers", "lightning", "pytest", "pytest_timeout"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "present"))
    except Exception as exc:
        print(name, "MISSING", type(exc).__name__, exc)
EOF

log "(a) tests/gpu"
timeout -k 10 "${TESTS_TIMEOUT:-210}" python3 -m pytest -q tests/gpu -p no:cacheprovider --durations=15 2>&1 | tee "$OUT/gpu_tests.txt"
rc_a=$?
log "(a) exit status $rc_a$([ "$rc_a" = 124 ] && echo ' (timed out)')"

log "(b) benchmarks/frameworks_cost.py"
# shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
timeout -k 10 "${BENCH_TIMEOUT:-330}" python3 benchmarks/frameworks_cost.py ${BENCH_ARGS:---device cuda --budget-s 270} \
    --out "$OUT/frameworks_cost.json" 2>&1 | tee "$OUT/frameworks_cost.txt"
rc_b=$?
log "(b) exit status $rc_b$([ "$rc_b" = 124 ] && echo ' (timed out)')"

log "done: tests $rc_a, benchmark $rc_b"
[ "$rc_a" = 0 ] && [ "$rc_b" = 0 ]
