#!/usr/bin/env bash
# The GPU check: one prepared run on one GPU, under 8 minutes with a cold start; fails fast, always leaves numbers.
# On the device machine (the session's `run` tool), from the repository root:
#     bash scripts/gpu_check.sh                 # extra arguments go to scripts/gpu_check.py (see --help)
# It appends every row to ${OUT:-gpu_check}/rows.jsonl as it is measured, writes gpu_check.json and gpu_check.md
# (the tables for docs/BENCHMARKS.md) and exits non-zero if the flex compile check fails or greedy SPD differs from
# AR. `timeout -k`: Lightning finishes its step before acting on SIGTERM, so a hung step gets SIGKILL 10 s later.
# Needs only torch, transformers, lightning, torchmetrics, safetensors (the `gpu` extra for the fast Gated DeltaNet
# kernels: without it the training rows are marked as the torch fallback).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
# Training, stage and draft latency, SPD == AR (scripts/gpu_check.py skips what would overrun its budget).
status=0
timeout -k 10 300 python scripts/gpu_check.py --out "$OUT" --budget-s 260 "$@" || status=$?
# The decoder at GPU speed (issue 17): eager vs captured stage and draft steps, decoder overhead per cycle and the
# planner's predicted speedups, on the 4B shape (compiling every (n, L_s) of both shapes would not fit 8 minutes).
timeout -k 10 130 python scripts/bench_decode_gpu.py --models 4b --n 4 8 --draft-layers 1 3 --iters 30 \
    --json "$OUT/decode_gpu.json" --md "$OUT/decode_gpu.md" || echo "bench_decode_gpu.py did not finish" >&2
exit "$status"
