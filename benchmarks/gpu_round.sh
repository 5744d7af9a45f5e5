#!/usr/bin/env bash
# One device call for issues 26-28 on the H200, each part bounded (the call's limit is 600 s):
#   the CUDA tests (tests/gpu: bitwise, syncs, the run-ahead, fused clip, integrity, fingerprints, fp8),
#   benchmarks/host_time.py (a step()'s added host time with its breakdown), and each new benchmark that exists:
#   integrity_cost.py (issue 27: the parameter check, one fingerprint pass, verify()), and table.py's groups
#   named in TABLE_GROUPS (issue 16's table, a second run for issue 26).
# torchao is not installed on the device: carry it (.whl, see the device README):
#   run(command="OUT=$OUT bash benchmarks/gpu_round.sh", carry=[".whl"])
cd "$(dirname "$0")/.." || exit 2
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/benchmarks/results/gpu_round}"; mkdir -p "$OUT"
start=$(date +%s); log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$OUT/session.txt"; }
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" >> "$OUT/session.txt" 2>&1
python3 -c "import torchao; print('torchao', torchao.__version__)" >> "$OUT/session.txt" 2>&1
part() {  # part NAME SECONDS COMMAND...: bounded, its output in $OUT/NAME.txt
  local name=$1 secs=$2; shift 2
  timeout -k 5 "$secs" "$@" > "$OUT/$name.txt" 2>&1; log "$name rc=$?"
}
part gpu_tests "${TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider tests/gpu
part host_time "${HOST_S:-120}" python3 benchmarks/host_time.py --device cuda --models mlp,gpt2-350m \
    --optims fused,foreach --blocks 8 --steps 30 --profile 0 --ops 0 --json "$OUT/host_time.json"
[ -f benchmarks/integrity_cost.py ] && part integrity_cost "${INTEG_S:-110}" python3 benchmarks/integrity_cost.py \
    --device cuda --model gpt2 --blocks 12 --block 8 --reps 20 --out "$OUT/integrity_cost.json"
[ -n "${TABLE_GROUPS:-}" ] && part table "${TABLE_S:-200}" python3 benchmarks/table.py --device cuda \
    --commit "${COMMIT:-?}" --groups "$TABLE_GROUPS" --blocks 20 --budget-s $(( ${TABLE_S:-200} - 30 )) \
    --out "$OUT/table.json"
log done
