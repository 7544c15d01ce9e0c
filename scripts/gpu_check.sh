#!/usr/bin/env bash
# The GPU check: one prepared run on one GPU, under 8 minutes with a cold start; fails fast, always leaves numbers.
# On the device machine (the session's `run` tool), from the repository root:
#     bash scripts/gpu_check.sh                 # extra arguments go to scripts/gpu_check.py (see --help)
# It appends every row to ${OUT:-gpu_check}/rows.jsonl as it is measured (the decoder's rows too), writes
# gpu_check.json and gpu_check.md (the tables for docs/BENCHMARKS.md, the decoder's generated from its rows) and exits
# non-zero if the flex compile check fails or greedy SPD differs from AR. `timeout -k`: Lightning finishes its step
# before acting on SIGTERM, so a hung step gets SIGKILL 10 s later.
# Needs only torch, transformers, lightning, torchmetrics, safetensors (the `gpu` extra for the fast Gated DeltaNet
# kernels: without it the training rows are marked as the torch fallback).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
# Training, stage and draft latency, SPD == AR (scripts/gpu_check.py skips what would overrun its 260 s budget), then
# the decoder at GPU speed (scripts/bench_decode_gpu.py as its child, 130 s at most, its rows in the same rows.jsonl).
status=0
timeout -k 10 440 python scripts/gpu_check.py --out "$OUT" --budget-s 260 --decode-s 130 "$@" || status=$?
exit "$status"
