#!/usr/bin/env bash
# The next session's first device call, as stop 63 left it (no device that stop): one call, ~450-500 s on an H100,
# every output in one tarball ($OUT/first.tgz: the device tool returns at most 8 files a call). Through the device
# tool, from the repository root:  OUT=$OUT bash benchmarks/results/cpu_stop63/device_first_call.sh
#   1. the fused rule's bits after 4f9b031 (TensorOps.recip a division): 0 of 360 decisions may differ
#   2. the Trainer's measurement replays with MeasureGraph's 24 graphs (2d60f55): its new test, then its graph keys
#   3. the whole tests/gpu with AMPGUARD_FUSED_RULE=1 (its default may turn on only if 1 and 3 hold)
# The second call, on the same lease: benchmarks/host_time.py --device cuda --models mlp,gpt2-350m --optims
# foreach,fused --blocks 6 --steps 30 --step-graph --fused-rule-arm, twice; the third: the sentinel's profile
# (benchmarks/table.py --device cuda --groups sentinel --blocks 8 --profile-steps 5).
set -uo pipefail
export PYTHONPATH=$PWD
R=$OUT/first
mkdir -p "$R"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c "import torch; print(torch.__version__)"; } \
  > "$R/gpu.txt" 2>&1
timeout -k 5 90 python benchmarks/results/cpu_stop62/fused_rule.py > "$R/fused_rule.txt" 2>&1
echo "fused_rule rc=$?"; tail -n 6 "$R/fused_rule.txt"
timeout -k 5 120 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_measure_graph.py -k trainer \
  > "$R/trainer_test.txt" 2>&1
echo "trainer test rc=$?"; grep -E "Trainer:|passed|failed" "$R/trainer_test.txt" | tail -n 3
timeout -k 5 120 python benchmarks/results/cpu_stop60/fw_graph_keys.py --frameworks transformers --steps 80 \
  > "$R/fw_graph_keys.txt" 2>&1
echo "fw_graph_keys rc=$?"; grep -A 3 "^transformers" "$R/fw_graph_keys.txt"
AMPGUARD_FUSED_RULE=1 timeout -k 5 330 python -m pytest -q -p no:cacheprovider -rfE tests/gpu > "$R/tests_fused_rule.txt" 2>&1
echo "tests/gpu with the fused rule rc=$?"; tail -n 8 "$R/tests_fused_rule.txt"
tar czf "$OUT/first.tgz" -C "$OUT" first && rm -rf "$R"
