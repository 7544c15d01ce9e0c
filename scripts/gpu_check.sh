#!/usr/bin/env bash
# The GPU check: one prepared run on one GPU, under 8 minutes with a cold start; fails fast, always leaves numbers.
# On the device machine (the session's `run` tool, carrying gpu_bundle/ if `make gpu-bundle` made it), from the
# repository root:
#     bash scripts/gpu_check.sh                 # extra arguments go to scripts/gpu_check.py (see --help)
# Sections in order, each a child with its own limit: the decoder (150 s), training (190 s), the compile checks
# (60 s). Every row goes to ${OUT:-gpu_check}/rows.jsonl as it is measured; gpu_check.json and gpu_check.md (the
# tables for docs/BENCHMARKS.md) are rebuilt from the rows after each section. Exits non-zero if the flex compile
# check fails or greedy SPD differs from AR. `timeout -k`: Lightning finishes its step before acting on SIGTERM,
# so a hung step gets SIGKILL 10 s later.
# Needs only what a stock GPU image has (python3, torch, transformers, lightning, torchmetrics, safetensors,
# numpy); the pure-Python wheels of gpu_bundle/ (flash-linear-attention's kernels) are installed beside the tree,
# offline, when present.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
PY=${PYTHON:-$(command -v python3 || command -v python)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
if compgen -G "gpu_bundle/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$OUT/site" gpu_bundle/*.whl
    export PYTHONPATH="$PWD/$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
status=0
timeout -k 10 440 "$PY" scripts/gpu_check.py --out "$OUT" --decode-s 150 --train-s 190 --compile-s 60 "$@" || status=$?
exit "$status"
