"""Where validation's prediction of `n*alpha` and a greedy decode part ways, measured (docs/SMOLLM2.md, "What
validation predicts").

    python scripts/replay_prediction.py --ckpt runs/smollm2_8m/checkpoints/last.ckpt --drafter runs/smollm2_8m/drafter \\
        --decode runs/smollm2_8m/heldout40.json --out runs/smollm2_8m/replay40.json
    python scripts/replay_prediction.py --ckpt runs/smollm2_8m/checkpoints/last.ckpt --drafter runs/smollm2_8m/drafter \\
        --target artifacts/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smollm2_8m/replay_val.json \\
        --fit-args --config configs/smollm2.yaml --data.draft_vocab_size 2048

The drafter's teacher-forced drafts at every fill of every answer token (`SPDModule.every_fill`), on one of two
sets of answers:

- `--decode`: the answers of an `inference.decode --json` at T = 0. There every output is the target's greedy token,
  whatever the drafter, so the walk (`fill_chain.walk`) gives what a T = 0 decode of any drafter (`--drafter`, or
  the checkpoint's own PDM) on those prompts gives; for the drafter the decode ran, it must be the decode's own
  accepted and rejected drafts per fill and its `n*alpha`, which the script checks (`counts_equal`, `n_alpha_equal`);
- `--fit-args`: the fit's validation split (the config's data, the target's own answers when the data is a T = 0
  regeneration): every answer token (`all`), each sequence's first answer (`first`), its first 63 drafted tokens
  (`first63`: what a 64-token decode judges), and validation's own logged figure before every fill was measured on
  every sequence (`rotated`: sample `b` measured at fill `(b + offset) mod n + 1` only).

For each it prints the refill chain's prediction from the acceptance per fill (`independent`: what validation logs)
and the walked decode's own `n * N / K` (`walked`: `fill_chain.walked_cycles`), each with a 95 % bootstrap interval
over the answers.
"""

from __future__ import annotations

import argparse
import json
import logging

import numpy as np
import torch

from inference.evaluation.intervals import bootstrap
from spd_lightning.data.chat import load_tokenizer, render_prompt
from spd_lightning.data.collate import answer_batch
from spd_lightning.export import load_drafter
from spd_lightning.fill_chain import (
    judged_acceptance,
    measured_prediction,
    predicted_n_alpha,
    walk,
    walked_counts,
    walked_cycles,
)
from spd_lightning.target import Target
from spd_lightning.training.module import SPDModule

log = logging.getLogger("replay_prediction")


def summary(tables: list[torch.Tensor], n: int) -> dict:
    """The chain's prediction from the mean acceptance per fill, and the walked one, each with its 95 % bootstrap
    interval over the answers (`tables`: one `[drafted tokens, n]` table per answer)."""
    walked = [walked_counts(t.tolist(), n) for t in tables]
    columns = {
        "tokens": [len(t) for t in tables],
        "N": [len(t) + 1 for t in tables],  # a token per judged draft, and the prefill's
        "K": [walked_cycles(t.tolist(), n) for t in tables],
        **{f"fill{k}": [int(t[:, k].sum()) for t in tables] for k in range(n)},
    }

    def independent(c) -> np.ndarray:
        p = np.stack([c[f"fill{k}"].sum(axis=1) for k in range(n)], axis=1) / c["tokens"].sum(axis=1)[:, None]
        return np.array([predicted_n_alpha([float(x) for x in row], n) for row in p])

    def walked_n_alpha(c) -> np.ndarray:
        return n * c["N"].sum(axis=1) / c["K"].sum(axis=1)

    intervals = bootstrap(columns, {"independent": independent, "walked": walked_n_alpha})
    whole = {name: np.array([values]) for name, values in columns.items()}  # the sample itself, as one resample
    p = torch.cat(tables).float().mean(0).tolist()
    return {
        "answers": len(tables),
        "drafted_tokens": sum(columns["tokens"]),
        "accept_by_fill": p,
        "independent": {"p_bar": judged_acceptance(p, n), "n_alpha": float(independent(whole)[0])},
        "walked": {
            "accepted_by_fill": [sum(w[0][k] for w in walked) for k in range(n)],
            "rejected_by_fill": [sum(w[1][k] for w in walked) for k in range(n)],
            "n_alpha": float(walked_n_alpha(whole)[0]),
        },
        "independent_interval": intervals["independent"],
        "walked_interval": intervals["walked"],
        "views_at_walked_fill": views_at_walked_fill(tables, n),
    }


def views_at_walked_fill(tables: list[torch.Tensor], n: int) -> list[list[float | None]]:
    """`[k - 1][j - 1]`: the acceptance, at the positions a decode judges at fill `k`, of drafts made there at fill
    `j`: whether a judged fill is held back by its view (row k rising towards j = 1) or by its positions (a flat row)."""
    hits, counts = torch.zeros(n, n), torch.zeros(n)
    for table in tables:
        for row, fill in zip(table.float(), walk(table.tolist(), n)):
            hits[fill - 1] += row
            counts[fill - 1] += 1
    return [[float(h / c) if c else None for h in hit_row] for hit_row, c in zip(hits, counts)]


def on_decode(module: SPDModule, pdm, decode: dict) -> dict:
    """The decode's own answers: the walk must give its counters."""
    n, tokenizer, tables = module.geometry.n, load_tokenizer(decode["target"]), []
    for i, row in enumerate(decode["prompts"]):
        prompt = render_prompt(tokenizer, row["prompt"])
        if len(prompt) != row["prompt_len"]:
            raise SystemExit(f"prompt {i} renders to {len(prompt)} tokens, the decode's had {row['prompt_len']}")
        tables.append(module.every_fill(answer_batch(prompt, row["tokens"]), pdm=pdm).answer_drafts(0))
        log.info("answer %d/%d", i + 1, len(decode["prompts"]))
    result = summary(tables, n)
    counters = [
        [sum(row[key][k] for row in decode["prompts"]) for k in range(n)]
        for key in ("accepted_by_fill", "rejected_by_fill")
    ]
    totals = decode["totals"]
    result["decode"] = {
        "accepted_by_fill": counters[0],
        "rejected_by_fill": counters[1],
        "n_alpha": n * totals["N"] / totals["K"],
    }
    walked = result["walked"]
    result["counts_equal"] = counters == [walked["accepted_by_fill"], walked["rejected_by_fill"]]
    result["n_alpha_equal"] = abs(walked["n_alpha"] - result["decode"]["n_alpha"]) < 1e-12
    return result


def on_validation(module: SPDModule, pdm, fit_args: list[str], batches: int) -> dict:
    """The fit's validation split, as `fit` splits it."""
    from spd_lightning.cli import SPDLightningCLI

    datamodule = SPDLightningCLI(fit_args, run=False).datamodule
    datamodule.setup("validate")
    n, sets = module.geometry.n, {"all": [], "first": [], "first63": []}
    hits, totals = [0] * n, [0] * n
    for b, batch in zip(range(batches), datamodule.val_dataloader()):
        B, T = batch["input_ids"].shape
        drafts = module.every_fill(batch, pdm=pdm)
        rotated = module.layout.validation_fill(B, T, b * B)  # `type`: a fill per sample; `depth`: per time
        rotated = (rotated[:, None] if rotated.dim() == 1 else rotated[:, :T]).expand(B, T) - 1
        own = drafts.accepted.gather(-1, rotated[..., None])[..., 0]  # [B, T]: at the fill validation gave it
        for row in range(B):
            counted = drafts.counted[row].bool()
            sets["all"].append(drafts.accepted[row][counted])
            sets["first"].append(drafts.answer_drafts(row))
            sets["first63"].append(drafts.answer_drafts(row, limit=63))
            for k, hit in zip(rotated[row][counted].tolist(), own[row][counted].tolist()):
                hits[k] += hit
                totals[k] += 1
        log.info("validation batch %d/%d", b + 1, batches)
    result = {name: summary(tables, n) for name, tables in sets.items()}
    measured = {k + 1: h / t for k, (h, t) in enumerate(zip(hits, totals)) if t}
    result["rotated"] = {"accept_by_fill": measured, "n_alpha": measured_prediction(measured, n)[1]}
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="the fit's Lightning checkpoint (its layout and geometry)")
    p.add_argument("--drafter", help="an exported drafter (the one the decode ran); default: the checkpoint's PDM")
    p.add_argument("--target", help="the target (default: the decode's)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--decode", help="an inference.decode --json of a T = 0 decode")
    source.add_argument(
        "--fit-args", nargs=argparse.REMAINDER, help="the fit's config arguments (its validation split)"
    )
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    decode = json.load(open(args.decode)) if args.decode else None
    if decode is not None and decode["sampling"]["temperature"] != 0:
        raise SystemExit("--decode must be a T = 0 decode: only there is every output the target's greedy token")
    module = SPDModule.load_from_checkpoint(args.ckpt, map_location="cpu").eval()
    target = Target.load(args.target or decode["target"], dtype="float32")
    module.use_target(target)
    pdm = load_drafter(args.drafter, target_head=target.lm_head.weight)[0] if args.drafter else module.pdm
    pdm = pdm.float().eval()
    if decode is not None:
        result = {"decode": on_decode(module, pdm, decode)}
    else:
        result = on_validation(module, pdm, args.fit_args, args.val_batches)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, r in result.items():
        if "independent" in r:
            lo, hi = r["independent_interval"]
            print(f"{name:8s} independent n*alpha={r['independent']['n_alpha']:.3f} [{lo:.2f}, {hi:.2f}]", end="  ")
            lo, hi = r["walked_interval"]
            print(f"walked n*alpha={r['walked']['n_alpha']:.3f} [{lo:.2f}, {hi:.2f}]  answers={r['answers']}")
        if "decode" in r:
            print(
                f"{name:8s} the decode's drafter: n*alpha={r['decode']['n_alpha']:.3f}; the walk equals its counts: "
                f"{r['counts_equal']}, its n*alpha: {r['n_alpha_equal']} (must, when it is the same drafter)"
            )
        if name == "rotated":
            print(f"rotated  independent n*alpha={r['n_alpha']:.3f} (each fill on its own samples)")


if __name__ == "__main__":
    main()
