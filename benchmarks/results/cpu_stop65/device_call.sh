#!/usr/bin/env bash
# Stop 65's seventh device call (it ran: benchmarks/results/gpu_stop65/, the call7_* files), after the first six
# (cpu_stop64/device_first_call.sh, host_time's second run, the two failing tests alone, the framework rows).
# Through the device tool, from the repository root, with .old65/ (HEAD aaeac74's ops.py and pipeline.py,
# git-ignored) carried:  OUT=$OUT bash benchmarks/results/cpu_stop65/device_call.sh
#   1. the fixed tests: the fused rule on a process's first step (new), the step_was_skipped reader (warm-up steps);
#   2. the new test on aaeac74's ops.py and pipeline.py (should fail: the warning);
#   3. move_diag.py (the moving-gradients test's replays step by step); 4. tests/gpu whole with the rule on.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
T=tests/gpu/test_gpu_step_graph.py
H=tests/gpu/test_gpu_host.py::test_a_reader_of_step_was_skipped_every_step_waits_for_the_decision_not_the_optimizer
AMPGUARD_FUSED_RULE=1 timeout -k 5 150 python -m pytest -q -p no:cacheprovider -rfE "$H" \
  "$T::test_the_fused_rule_compiles_on_the_first_step_of_a_process" > "$OUT/fixed.txt" 2>&1
echo "fixed tests, rule on: rc=$?"; tail -n 3 "$OUT/fixed.txt"
AMPGUARD_FUSED_RULE=0 timeout -k 5 60 python -m pytest -q -p no:cacheprovider -rfE "$H" >> "$OUT/fixed.txt" 2>&1
echo "reader test, rule off: rc=$?"; tail -n 1 "$OUT/fixed.txt"
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r ampguard tests pyproject.toml /tmp/old/ && cp .old65/*.py /tmp/old/ampguard/
(cd /tmp/old && PYTHONPATH=/tmp/old timeout -k 5 60 python -m pytest -q -p no:cacheprovider -rfE \
  "$T::test_the_fused_rule_compiles_on_the_first_step_of_a_process") > "$OUT/before.txt" 2>&1
echo "the new test on aaeac74's library (should fail): rc=$?"; grep -E "Warning:|passed|failed" "$OUT/before.txt" | head -3
timeout -k 5 90 python benchmarks/results/cpu_stop65/move_diag.py > "$OUT/move_diag.txt" 2>&1
echo "move_diag rc=$?"; cat "$OUT/move_diag.txt" | grep -v Warning | head -n 44
AMPGUARD_FUSED_RULE=1 timeout -k 5 345 python -m pytest -q -p no:cacheprovider -rfE tests/gpu > "$OUT/tests_rule.txt" 2>&1
echo "tests/gpu with the fused rule rc=$?"; tail -n 6 "$OUT/tests_rule.txt"
