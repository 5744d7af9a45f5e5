#!/usr/bin/env bash
# Stop 66's device calls: stop 65's device_next.sh parts, regrouped into three calls after three refused starts left
# ~1400 s of device time (stop 65's plan needed ~1700). Through the device tool, from the repository root:
#   CALL=A OUT=$OUT bash benchmarks/results/cpu_stop66/device_calls.sh   (<= 545 s) device_next.sh PART=1: tests/gpu whole
#     with AMPGUARD_FUSED_RULE=1, then move_diag.py
#   CALL=B (<= 575 s; SENT_S=100 FW_S=200: <= 485 s) the sentinel summed and batched over the default guard
#     (table.py's sentinel group, with peak memory and, in run 1, the kernels), the framework rows with each arm in
#     its own process (--isolate), the sentinel again
#   CALL=C (<= 300 s) host_time.py's fused-rule arm on the MLP, fused and foreach, with its capture misses and a cProfile
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
sentinel() {  # sentinel RUN PROFILE_STEPS BUDGET
  timeout -k 5 $(( $3 + 35 )) python benchmarks/table.py --device cuda --groups sentinel --blocks 30 --budget-s "$3" \
    --profile-steps "$2" --no-syncs --out "$OUT/sentinel_$1.json" > "$OUT/sentinel_$1.txt" 2>&1
  echo "sentinel run $1 rc=$?"; grep -E "sentinel|peak" "$OUT/sentinel_$1.txt" | head -n 12
}
case "${CALL:-A}" in
A) PART=1 bash benchmarks/results/cpu_stop65/device_next.sh ;;
B) sentinel 1 5 "${SENT_S:-125}"
   for base in guard_fused guard_sentinel_fused; do
     python benchmarks/results/cpu_stop64/kernel_diff.py "$OUT/sentinel_1.json" guard_sentinelbatch_fused "$base" \
       | head -n 12 | tee -a "$OUT/sentinel_kernels.txt"
   done
   if [ "${FW_S:-230}" != 0 ]; then  # FW_S=0: no framework rows
     FIRST=0 TESTS=0 HOST=0 FRAMEWORKS=1 FRAMEWORKS_S="${FW_S:-230}" FW_BLOCKS=30 FW_ISOLATE=1 \
       bash benchmarks/gpu_issue26.sh isolated > "$OUT/fw_isolated.log" 2>&1
     grep -A4 "^framework " "$OUT/frameworks_isolated.txt"; grep "captures" "$OUT/frameworks_isolated.txt"
   fi
   sentinel 2 0 "${SENT_S:-110}" ;;
C) timeout -k 5 280 python benchmarks/host_time.py --device cuda --models mlp --optims foreach,fused \
     --blocks 6 --steps 30 --step-graph --fused-rule-arm --profile 30 > "$OUT/host_time.txt" 2>&1
   echo "host_time rc=$?"; grep -E "on cuda|guard with|the fused rule|_learn_skip|_measure" "$OUT/host_time.txt" ;;
esac
# at most 8 files come back: B's ten go back as one tarball
[ "${CALL:-A}" = B ] && (cd "$OUT" && shopt -s nullglob && tar czf call_B.tgz --remove-files -- *.txt *.json *.log)
exit 0
