#!/usr/bin/env bash
# One call on a lent GPU machine (torch there, not this venv): `make test-gpu`, then
# benchmarks/gpu_check.py alone on the card, the logs and JSON under OUT (default ./gpu-out).
#   scripts/gpu_session.sh [SECONDS] [GPU_CHECK_SECTIONS]
# SECONDS bounds the whole script (default 560); the tests get up to 200 of it, gpu_check the
# rest less a margin. nanoGPT's model.py is read from NANOGPT (default .nanogpt), and the commit
# from COMMIT where the tree travelled without .git.
set -o pipefail
TOTAL=${1:-560}
SECTIONS=${2:-matmul,decode,serve,train32,loader}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
{
    nvidia-smi -L
    python3 -c "import torch, transformers, sys; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'transformers', transformers.__version__, 'python', sys.version.split()[0])"
} 2>&1 | tee "$OUT/test_gpu.log"
timeout 200 make test-gpu PY=python3 ARGS="--durations=12" 2>&1 | tee -a "$OUT/test_gpu.log"
echo "make test-gpu: exit $? after $(elapsed) s" | tee -a "$OUT/test_gpu.log"
BUDGET=$(( TOTAL - $(elapsed) - 50 ))  # the margin: a section's grace past its budget
COMMIT_ARG=()
[ -n "${COMMIT:-}" ] && COMMIT_ARG=(--commit "$COMMIT")
python3 benchmarks/gpu_check.py --nanogpt "${NANOGPT:-.nanogpt}" --out "$OUT/gpu_check.json" \
    --sections "$SECTIONS" --budget "$BUDGET" "${COMMIT_ARG[@]}" 2>&1 | tee "$OUT/gpu_check.log"
echo "done after $(elapsed) s"
