#!/usr/bin/env bash
# The end-to-end demo on the embedded default: tiny Qwen3.5 target -> trained drafter -> pipeline decode.
# Called by `make demo` (which creates the environment first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TARGET=${TARGET:-artifacts/tiny_target}
RUN=runs/tiny   # where configs/tiny.yaml writes checkpoints and logs
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ ! -f "$TARGET/config.json" ]; then
  # A step count and a thread count, not a time budget: every machine builds the same target (~4 min on 2 cores).
  echo "== 1/4 building the embedded tiny Qwen3.5 target in $TARGET (360 steps, a few minutes)"
  "$PY" -m spd_lightning.tiny_target --out "$TARGET" --max-steps 360 --threads 2
else
  echo "== 1/4 tiny target found in $TARGET (delete it to rebuild)"
fi

echo "== 2/4 training the drafter: python -m spd_lightning fit --config configs/tiny.yaml"
rm -rf "$RUN/checkpoints"   # a rerun trains afresh instead of versioning last.ckpt into last-v1.ckpt
"$PY" -m spd_lightning fit --config configs/tiny.yaml --model.target "$TARGET"

echo "== 3/4 exporting it"
"$PY" -m spd_lightning export --ckpt "$RUN/checkpoints/last.ckpt" --out "$RUN/drafter"

echo "== 4/4 decoding held-out prompts with n stage processes + 1 PDM process (gloo), checked against AR"
echo "   note: a few CPU minutes of pretraining give a repetitive target, so its alpha is an upper bound"
"$PY" -m inference.decode --ckpt "$RUN/drafter" --target "$TARGET" --prompts docs/demo_prompts.jsonl \
  --max-new-tokens 64 --check-lossless --json "$RUN/decode.json"
