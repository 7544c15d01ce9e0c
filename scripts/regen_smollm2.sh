#!/usr/bin/env bash
# Continue the SmolLM2 training data: the target's greedy answers to the usable ShareGPT first turns of records
# 0..14,999 (records from 15,000 on are the held-out range, scripts/sharegpt_heldout.py). The answers written so far
# are committed as data/smollm2/regen_t0.jsonl.gz; this unpacks them, lets `prepare --regenerate` continue after the
# last complete record (resumable, prompt order fixed), and packs the grown file back on exit, so a CPU session that
# is cut off loses at most one batch. Needs the converted target (`make demo` links and converts it once).
#   nice -n 15 bash scripts/regen_smollm2.sh            # then commit data/smollm2/regen_t0.jsonl.gz
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
COMMITTED=data/smollm2/regen_t0.jsonl.gz
WORK=artifacts/smollm2/regen_t0.jsonl
TARGET=artifacts/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -e "$TARGET" ] || { echo "error: $TARGET is missing: run 'make demo' once (it installs and links the GGUF)" >&2; exit 2; }
mkdir -p "$(dirname "$WORK")"
if [ ! -f "$WORK" ] && [ -f "$COMMITTED" ]; then gunzip -c "$COMMITTED" > "$WORK"; fi
pack() {  # never replace the committed answers with fewer
  local have=0; [ -f "$COMMITTED" ] && have=$(gunzip -c "$COMMITTED" | wc -l)
  if [ "$(wc -l < "$WORK")" -gt "$have" ]; then gzip -9 -c "$WORK" > "$COMMITTED.tmp" && mv "$COMMITTED.tmp" "$COMMITTED"; fi
  echo "$(gunzip -c "$COMMITTED" | wc -l) answers in $COMMITTED"
}
trap pack EXIT
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -m spd_lightning prepare --config configs/smollm2.yaml --data.sources '[{path: sharegpt, max_samples: 15000}]' \
  --regenerate "$WORK" --max-prompt-tokens 96 --max-new-tokens 150 --gen-batch-size 64 "$@"
