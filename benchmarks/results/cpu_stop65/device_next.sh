#!/usr/bin/env bash
# The next session's device calls, as stop 65 left them. Through the device tool, from the repository root:
#   PART=1 OUT=$OUT bash benchmarks/results/cpu_stop65/device_next.sh   (~500 s on an H100)
#     tests/gpu whole with AMPGUARD_FUSED_RULE=1 (83 tests since stop 65: 345 s was too short there), then
#     move_diag.py (the moving-gradients test's first steps, the gradients' addresses read before zero_grad now).
#   PART=2 OUT=$OUT bash benchmarks/results/cpu_stop65/device_next.sh   (~260 s)
#     host_time.py's fused-rule arm, whose line now prints capture_misses: 0 means the captures held the compiled
#     rule. The rule's default turns on only where part 1 passes whole (the healthy-loop test among it) and part 2
#     shows the gain with 0 misses (switches.py, tests/unit/test_config.py, the docs).
#   PART=3 OUT=$OUT bash benchmarks/results/cpu_stop65/device_next.sh   (~400 s)
#     the sentinel summed and batched (AMPGUARD_SENTINEL_BATCH, stop 65), each over the default guard, twice, with
#     peak memory; then the batched arm's kernels over the guard's and over the summed sentinel's. The switch turns on
#     where the batched arm is the cheaper in both runs and its peak is the summed one's.
#   PART=4 OUT=$OUT bash benchmarks/results/cpu_stop65/device_next.sh   (~530 s)
#     the framework rows with each arm in its own process (frameworks_cost.py --isolate), then as before.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${PART:-1}" = 1 ]; then
  AMPGUARD_FUSED_RULE=1 timeout -k 5 450 python -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/gpu \
    > "$OUT/tests_rule.txt" 2>&1
  echo "tests/gpu with the fused rule rc=$?"; tail -n 8 "$OUT/tests_rule.txt"
  timeout -k 5 90 python benchmarks/results/cpu_stop65/move_diag.py > "$OUT/move_diag.txt" 2>&1
  echo "move_diag rc=$?"; grep -v Warning "$OUT/move_diag.txt" | head -n 44
elif [ "${PART}" = 4 ]; then
  # the framework rows with each arm in its own process (--isolate, stop 65: in one process every guarded arm
  # captured once a round), then as before, in one call: the captures per arm and the ratios side by side
  for mode in isolated shared; do
    FIRST=0 TESTS=0 HOST=0 FRAMEWORKS=1 FRAMEWORKS_S=250 FW_BLOCKS=30 FW_ISOLATE=$([ $mode = isolated ] && echo 1) \
      bash benchmarks/gpu_issue26.sh > "$OUT/fw_$mode.log" 2>&1
    mv "$OUT/frameworks_now.json" "$OUT/frameworks_$mode.json"; mv "$OUT/frameworks_now.txt" "$OUT/frameworks_$mode.txt"
    echo "== $mode"; grep -A4 "^framework " "$OUT/frameworks_$mode.txt"; grep "captures" "$OUT/frameworks_$mode.txt"
  done
elif [ "${PART}" = 3 ]; then
  for run in 1 2; do
    timeout -k 5 190 python benchmarks/table.py --device cuda --groups sentinel --blocks 24 --budget-s 150 \
      --profile-steps "$(( run == 1 ? 5 : 0 ))" --no-syncs --out "$OUT/sentinel_$run.json" > "$OUT/sentinel_$run.txt" 2>&1
    echo "sentinel run $run rc=$?"; grep -E "sentinel|peak" "$OUT/sentinel_$run.txt" | head -n 12
  done
  for base in guard_fused guard_sentinel_fused; do
    python benchmarks/results/cpu_stop64/kernel_diff.py "$OUT/sentinel_1.json" guard_sentinelbatch_fused "$base" \
      | head -n 12 | tee -a "$OUT/sentinel_kernels.txt"
  done
else
  timeout -k 5 420 python benchmarks/host_time.py --device cuda --models mlp,gpt2-350m --optims foreach,fused \
    --blocks 6 --steps 30 --step-graph --fused-rule-arm > "$OUT/host_time.txt" 2>&1
  echo "host_time rc=$?"; grep -E "on cuda|guard with|the fused rule" "$OUT/host_time.txt"
fi
