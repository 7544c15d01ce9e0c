"""Write held-out ShareGPT prompts as an EAGLE-style jsonl set for `python -m inference.eval`.

    python scripts/sharegpt_heldout.py --skip 15000 --count 40 --out runs/bench_smollm2/sharegpt.jsonl

Training reads the embedded ShareGPT file from its start (`sources: [{path: sharegpt, max_samples: M}]`),
so records at or past `--skip M` are conversations no drafter trained on, but not always prompts none
trained on: ShareGPT repeats prompts across records (record 15,010's "test" is also records 2,669 and
2,803). A record is held out only when its first user message matches no user message of the first
`--skip` records by content, compared exactly and with whitespace normalized (runs of spaces, tabs and
newlines as one space, ends stripped), and no prompt already taken. Each output line is
`{"question_id", "category": "sharegpt", "record", "turns": [first user message]}`; first messages longer
than `--max-chars` are skipped so the set's prompts are as short as GSM8K's and HumanEval's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from spd_lightning.data.formats import USER, normalize_conversation
from spd_lightning.data.sharegpt import load_embedded_sharegpt


def content_key(text: str) -> str:
    """What two prompts equal by content share: the text with whitespace runs as one space, ends stripped."""
    return " ".join(text.split())


def user_messages(record: dict, index: int) -> list[str]:
    messages = normalize_conversation(record["conversations"], "conversations", f"record {index}")
    return [m["content"].strip() for m in messages if m["role"] == USER]


def heldout_prompts(records: list[dict], skip: int, count: int, max_chars: int) -> list[tuple[int, str]]:
    """(record index, first user message) of the first `count` records at index >= `skip` whose first user
    message is no training record's user message (records < `skip`) by content, nor an earlier pick's."""
    seen = {content_key(m) for i, record in enumerate(records[:skip]) for m in user_messages(record, i)}
    picked: list[tuple[int, str]] = []
    for index in range(skip, len(records)):
        first = next(iter(user_messages(records[index], index)), "")
        key = content_key(first)
        if key and len(first) <= max_chars and key not in seen:
            picked.append((index, first))
            seen.add(key)
        if len(picked) == count:
            return picked
    raise SystemExit(
        f"error: only {len(picked)} usable prompts in records {skip}..{len(records) - 1}: "
        f"lower --count or raise --max-chars"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip", type=int, required=True, help="records training may read (the config's max_samples)")
    p.add_argument("--count", type=int, default=40)
    p.add_argument("--max-chars", type=int, default=600)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.skip < 0 or args.count < 1 or args.max_chars < 1:
        sys.exit("error: --skip must be >= 0, --count and --max-chars >= 1")
    records = load_embedded_sharegpt(max_samples=args.skip + 50 * args.count)
    prompts = heldout_prompts(records, args.skip, args.count, args.max_chars)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        for i, (record, text) in enumerate(prompts):
            f.write(json.dumps({"question_id": i, "category": "sharegpt", "record": record, "turns": [text]}) + "\n")
    print(
        f"wrote {len(prompts)} held-out ShareGPT prompts (records {prompts[0][0]}..{prompts[-1][0]}, none equal by "
        f"content to a user message of records 0..{args.skip - 1}) to {args.out}"
    )


if __name__ == "__main__":
    main()
