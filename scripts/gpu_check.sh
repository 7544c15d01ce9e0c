#!/usr/bin/env bash
# The GPU check (SPEC 14): one prepared run on one GPU, under 8 minutes with a cold start.
# On the device machine (the session's `run` tool), from the repository root:
#     bash scripts/gpu_check.sh                 # extra arguments go to scripts/gpu_check.py (see --help)
# It writes ${OUT:-gpu_check}/gpu_check.json and gpu_check.md (the tables for docs/BENCHMARKS.md) and exits
# non-zero if greedy SPD differs from AR. Needs only torch, transformers, lightning, torchmetrics, safetensors.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
# Training, stage and draft latency, SPD == AR (scripts/gpu_check.py skips what would overrun its budget).
status=0
timeout 300 python scripts/gpu_check.py --out "$OUT" --budget-s 260 "$@" || status=$?
# The decoder at GPU speed (issue 17): eager vs captured stage and draft steps, decoder overhead per cycle and the
# planner's predicted speedups, on the 4B shape (compiling every (n, L_s) of both shapes would not fit 8 minutes).
timeout 130 python scripts/bench_decode_gpu.py --models 4b --n 4 8 --draft-layers 1 3 --iters 30 \
    --json "$OUT/decode_gpu.json" --md "$OUT/decode_gpu.md" || echo "bench_decode_gpu.py did not finish" >&2
exit "$status"
