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
exec timeout 450 python scripts/gpu_check.py --out "${OUT:-gpu_check}" "$@"
