"""Write held-out ShareGPT prompts as an EAGLE-style jsonl set for `python -m inference.eval`.

    python scripts/sharegpt_heldout.py --skip 20000 --count 20 --out runs/bench/sharegpt_heldout.jsonl

Training reads the embedded ShareGPT file from its start (`sources: [{path: sharegpt, max_samples: M}]`),
so records at or past `--skip M` are conversations no drafter trained on. Each output line is
`{"question_id", "category": "sharegpt", "turns": [first user message]}`; first messages longer than
`--max-chars` are skipped so the set's prompts are as short as GSM8K's and HumanEval's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from spd_lightning.data.formats import USER, normalize_conversation
from spd_lightning.data.sharegpt import load_embedded_sharegpt


def heldout_prompts(skip: int, count: int, max_chars: int) -> list[str]:
    """First user messages of the first `count` usable records at index >= `skip`, in file order."""
    records = load_embedded_sharegpt(max_samples=skip + 50 * count)[skip:]
    prompts: list[str] = []
    for index, record in enumerate(records):
        messages = normalize_conversation(record["conversations"], "conversations", f"record {skip + index}")
        first = next((m["content"].strip() for m in messages if m["role"] == USER), "")
        if first and len(first) <= max_chars:
            prompts.append(first)
        if len(prompts) == count:
            return prompts
    raise SystemExit(
        f"error: only {len(prompts)} usable prompts in records {skip}..{skip + len(records) - 1}: "
        f"lower --count or raise --max-chars"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip", type=int, required=True, help="records training may read (the config's max_samples)")
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--max-chars", type=int, default=600)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.skip < 0 or args.count < 1 or args.max_chars < 1:
        sys.exit("error: --skip must be >= 0, --count and --max-chars >= 1")
    prompts = heldout_prompts(args.skip, args.count, args.max_chars)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        for i, text in enumerate(prompts):
            f.write(json.dumps({"question_id": i, "category": "sharegpt", "turns": [text]}) + "\n")
    print(f"wrote {len(prompts)} held-out ShareGPT prompts (records from {args.skip}) to {args.out}")


if __name__ == "__main__":
    main()
