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
# numpy); the pure-Python wheels of ${GPU_BUNDLE:-gpu_bundle}/ (flash-linear-attention's kernels) are installed
# offline when present: into a fresh folder under ${TMPDIR:-/tmp}, not under $OUT (only a few files come back from
# there), put on PYTHONPATH by its absolute path. A bundle that does not install, or whose kernels transformers
# would not import, is one error line and a non-zero exit; the check still runs (on the torch fallback).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
PY=${PYTHON:-$(command -v python3 || command -v python)}
BUNDLE=${GPU_BUNDLE:-gpu_bundle}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"

install_bundle() {  # the import is the one transformers' Qwen3.5 modeling makes (`import fla` alone hides errors)
    local site
    site=$(mktemp -d "${TMPDIR:-/tmp}/spd_gpu_site.XXXXXX") || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$BUNDLE"/*.whl || return 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c "from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule"
}

status=0
if compgen -G "$BUNDLE/*.whl" >/dev/null && ! install_bundle; then
    echo "error: $BUNDLE/ was carried but flash-linear-attention's kernels do not install or import (see above):" \
        "every Gated DeltaNet layer runs transformers' torch fallback" >&2
    status=3
fi
timeout -k 10 440 "$PY" scripts/gpu_check.py --out "$OUT" --decode-s 150 --train-s 190 --compile-s 60 "$@" || status=$?
exit "$status"
