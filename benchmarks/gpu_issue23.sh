#!/usr/bin/env bash
# One device call for issues 23/24 after their merges: the CUDA tests (bitwise guarantees, no hook on
# healthy steps), the real-model classification suite on CUDA (tiny families and GPT-2 124M), each part
# bounded so the whole call ends inside one device command.
#   OUT=/tmp/o bash benchmarks/gpu_issue23.sh        (from the repository root)
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/benchmarks/results/gpu_issue23}"; mkdir -p "$OUT"
start=$(date +%s); log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$OUT/session.txt"; }
python3 -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)" >> "$OUT/session.txt" 2>&1
timeout -k 10 "${HF_TIMEOUT:-180}" python3 benchmarks/hf_classification.py --device cuda --out "$OUT/hf_classification.json" \
    > "$OUT/hf_classification.txt" 2>&1; log "hf_classification rc=$?"
timeout -k 10 "${HF124_TIMEOUT:-120}" python3 benchmarks/hf_classification.py --device cuda --gpt2-124m \
    --out "$OUT/hf_classification_gpt2_124m.json" > "$OUT/hf_classification_gpt2_124m.txt" 2>&1; log "hf 124M rc=$?"
timeout -k 10 "${TESTS_TIMEOUT:-240}" python3 -m pytest -q tests/gpu -p no:cacheprovider \
    > "$OUT/gpu_tests.txt" 2>&1; log "tests/gpu rc=$?"
