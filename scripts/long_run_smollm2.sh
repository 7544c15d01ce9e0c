#!/usr/bin/env bash
# The long CPU run behind docs/SMOLLM2.md, in order, every step resumable, so that each session starts the same
# command and it goes on where the last session's stopped, when the machine kept runs/ (never its processes; on
# 2026-12-04 one session's machine kept runs/, the next one's did not: docs/SMOLLM2.md):
#   1. the target, installed and converted once (scripts/smollm2_target.sh);
#   2. the training answers, unpacked from data/smollm2/regen_t0.jsonl.gz once;
#   3. the target-state cache every PDM drafter reads (`curve-states`, resumed by shard);
#   4. the 8 M-token drafter (scripts/train_smollm2.sh, resumed from its last.ckpt);
#   5. that drafter exported, stored in bf16 as a committed one is, and decoded on the 40 held-out prompts beside the
#      committed drafter, with intervals and their paired difference (each decode skipped once its json exists);
#   6. the training-budget curve (`curve-train`, `curve-eval`; both skip what is done): first the three drafters that
#      decide the paper's claim (SPD and PPSD at n = 8, L_s = 1, and EAGLE-3) and their tables, then the others.
# It lowers its own CPU share first, so that tests and builds beside it keep the cores.
#   (setsid nohup bash scripts/long_run_smollm2.sh >> runs/long_run.log 2>&1 &)   # start, or resume
#   pkill -TERM -f "spd_lightning fit"   # stop before a session ends: the training saves its last.ckpt first
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PY WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2

# nice orders processes only within their autogroup (one per session while the kernel's sched_autogroup is on), so a
# run started under setsid lowers its own group too; never the caller's group, which would slow the caller's shell.
renice -n 19 -p $$ > /dev/null
if [ "$(ps -o sid= -p $$ | tr -d ' ')" = "$$" ] && [ -w /proc/$$/autogroup ]; then echo 19 > /proc/$$/autogroup; fi

mkdir -p runs
exec 9> runs/long_run.lock  # one run at a time: two would write the same checkpoints and cache shards
flock -n 9 || { echo "error: scripts/long_run_smollm2.sh is already running (runs/long_run.lock)" >&2; exit 1; }
step() { echo "$(date -u '+%F %T') == $*"; }
DRAFTER=runs/smollm2_8m/drafter
HELDOUT=runs/bench_smollm2/sharegpt.jsonl  # the 40 held-out prompts; the curve reads the same file
TARGET=artifacts/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

step "1/6 the target"
bash scripts/smollm2_target.sh
step "2/6 the training answers"
[ -f artifacts/smollm2/regen_t0.jsonl ] || gunzip -c data/smollm2/regen_t0.jsonl.gz > artifacts/smollm2/regen_t0.jsonl
step "3/6 the target-state cache (progress: runs/bench_smollm2/states.log)"
"$PY" scripts/bench_paper.py curve-states --suite smollm2 --threads 2
step "4/6 the 8 M-token drafter (progress: runs/smollm2_8m/fit/*/metrics.csv)"
bash scripts/train_smollm2.sh
step "5/6 the 8 M-token drafter on the 40 held-out prompts"
[ -f "$HELDOUT" ] || "$PY" scripts/sharegpt_heldout.py --skip 15000 --count 40 --out "$HELDOUT"
heldout() {  # heldout DRAFTER JSON: decode the 40 prompts once
  [ -f "$2" ] && return
  "$PY" -m inference.decode --ckpt "$1" --target "$TARGET" --prompts "$HELDOUT" --max-new-tokens 64 \
    --simulate --check-lossless --json "$2.part" > "$2.log"
  mv "$2.part" "$2"
}
if [ ! -f runs/smollm2_8m/heldout40.json ]; then
  "$PY" -m spd_lightning export --ckpt runs/smollm2_8m/checkpoints/last.ckpt --out "$DRAFTER"
  "$PY" scripts/shrink_drafter.py "$DRAFTER"
fi
heldout "$DRAFTER" runs/smollm2_8m/heldout40.json
heldout drafters/smollm2-135m runs/smollm2_8m/committed40.json  # the committed drafter when the run ended
"$PY" scripts/decode_compare.py committed=runs/smollm2_8m/committed40.json end=runs/smollm2_8m/heldout40.json \
  | tee runs/smollm2_8m/compare40.md
step "6/6 the training-budget curve (logs: runs/bench_smollm2/*/)"
DECIDING=(curve_spd_n8_L1 curve_ppsd_n8_L1 curve_eagle3)
# The CPU protocol: 14 prompts a set (42), 64 tokens, T = 0. The curve's own (40 a set, 128 tokens, T = 0 and 1)
# costs about 4 h per drafter and budget on 2 cores (docs/BENCHMARKS.md, "SmolLM2: speedup against training budget").
PROTOCOL=(--limit 14 --max-new-tokens 64 --temperatures 0)
for names in "${DECIDING[*]}" all; do
  # shellcheck disable=SC2086 # the names are words
  "$PY" scripts/bench_paper.py curve-train $names --suite smollm2 --jobs 1 --threads 2
  # shellcheck disable=SC2086
  "$PY" scripts/bench_paper.py curve-eval $names --suite smollm2 --jobs 1 --threads 2 "${PROTOCOL[@]}"
  "$PY" scripts/bench_paper.py curve --suite smollm2 "${PROTOCOL[@]}" --out runs/bench_smollm2/curve.md \
    --png runs/bench_smollm2/curve.png
done
step "done: runs/bench_smollm2/curve.md (python scripts/bench_paper.py curve --suite smollm2 puts it in docs/BENCHMARKS.md)"
