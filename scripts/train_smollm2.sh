#!/usr/bin/env bash
# Train a SmolLM2 drafter from the target-state cache, resumably: a run cut off (a CPU session's end, SIGTERM) saves
# its step's checkpoint and the same command continues from `OUT/checkpoints/last.ckpt`, with the same learning-rate
# schedule (it decays over STEPS). The recipe is configs/smollm2.yaml's (SPD n = 8, L_s = 1, fills `auto`); the cache
# is the one `scripts/bench_paper.py curve-states --suite smollm2` builds (every anchor of the curve's drafters and of
# this config; nothing in it depends on V_d), so a V_d comparison and the curve read the same bytes.
#   nice -n 19 bash scripts/train_smollm2.sh                         # V_d 2048, 16,500 steps into runs/smollm2_8m
#   OUT=runs/vd14k VD=14000 nice -n 19 bash scripts/train_smollm2.sh  # the same with another draft vocabulary
# More `fit` options go after the script's name (they come last, so they win).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/smollm2_8m}
VD=${VD:-2048}
STEPS=${STEPS:-16500}  # 8.1 M loss tokens: 493 per step at batch 4 on these chats (the V_d runs' train/loss_tokens)
STATES=${STATES:-runs/bench_smollm2/states}
[ -f "$STATES/manifest.json" ] || {
  echo "error: no state cache in $STATES: build it with 'python scripts/bench_paper.py curve-states --suite smollm2'" >&2
  exit 2
}
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
STAIRCASE='[{class_path: callbacks.StaircaseEvaluation, init_args: {every_n_steps: 2000, num_prompts: 4, max_new_tokens: 32}}]'
args=(
  --config configs/smollm2.yaml --data.states "$STATES" --data.draft_vocab_size "$VD"
  --trainer.max_steps "$STEPS" --trainer.max_epochs -1 --trainer.val_check_interval 250 --trainer.limit_val_batches 8
  --trainer.callbacks "$STAIRCASE"
  --trainer.default_root_dir "$OUT" --trainer.logger.init_args.save_dir "$OUT"
  --checkpoint.dirpath "$OUT/checkpoints" --checkpoint.every_n_train_steps 1000
)
LAST="$OUT/checkpoints/last.ckpt"
[ -f "$LAST" ] && args+=(--ckpt_path "$LAST")
exec "$PY" -m spd_lightning fit "${args[@]}" "$@"
