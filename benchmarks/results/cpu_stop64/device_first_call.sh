#!/usr/bin/env bash
# The next session's first device call, as stop 64 left it: one call, ~420-480 s on an H100, every output in one
# tarball ($OUT/first.tgz: the device tool returns at most 8 files a call). Through the device tool, from the
# repository root:  OUT=$OUT bash benchmarks/results/cpu_stop64/device_first_call.sh
#   1. the whole tests/gpu with AMPGUARD_FUSED_RULE=1, on d03432d's code (each guard compiles its own copy of the
#      tail's code; a capture never compiles). Stop 64's run on c240460 failed 10 of 82 (gpu_stop64/README.md). If it
#      passes whole, the switch's default turns on (switches.py, tests/unit/test_config.py, the docs).
#   2. the sentinel's profile with its per-kernel table (table.py --out: ops_per_step per variant): which kernels
#      carry the +43 launches and +0.17 ms a step stop 64 counted.
# The second call, on the same lease: host_time.py --device cuda --models mlp,gpt2-350m --optims foreach,fused
# --blocks 6 --steps 30 --step-graph --fused-rule-arm (its second run; gpu_stop64/host_time_1.txt is the first).
set -uo pipefail
export PYTHONPATH=$PWD
R=$OUT/first
mkdir -p "$R"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch; print(torch.__version__)"; } \
  > "$R/gpu.txt" 2>&1
AMPGUARD_FUSED_RULE=1 timeout -k 5 340 python -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/gpu \
  > "$R/tests_fused_rule.txt" 2>&1
echo "tests/gpu with the fused rule rc=$?"; tail -n 8 "$R/tests_fused_rule.txt"
timeout -k 5 90 python benchmarks/table.py --device cuda --groups sentinel --blocks 4 --profile-steps 5 --no-memory \
  --no-syncs --out "$R/sentinel_profile.json" > "$R/sentinel_profile.txt" 2>&1
echo "sentinel profile rc=$?"; grep -A 4 "kernels/step" "$R/sentinel_profile.txt"
python benchmarks/results/cpu_stop64/kernel_diff.py "$R/sentinel_profile.json" | tee "$R/sentinel_kernels.txt" | head -n 14
tar czf "$OUT/first.tgz" -C "$OUT" first && rm -rf "$R"
