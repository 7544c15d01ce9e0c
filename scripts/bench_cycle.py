"""Cycle profile of the multi-process decoder: where one pipeline cycle's wall time goes.

    .venv/bin/python scripts/bench_cycle.py --n 2 4 --label after --json runs/bench/after_1.json
    .venv/bin/python scripts/bench_cycle.py --table runs/bench/*.json --png docs/cycle_profile.png

The first form launches, for each `n`, `n` stage processes + 1 PDM process (gloo on CPU, the real
`launch` path; `--pdm-placement shared`: `n` processes, the PDM in stage 1's) on the target, decodes the prompts `--repeat` times after a warm-up, and writes per-cycle
means over every cycle of every prompt (the median over the repeats):

- wall: the reporting (last-stage) rank's time per cycle; with optimistic execution the step that a late
  rejection wastes is counted in the cycle it repeats, so `wall * K` is the decode time;
- slowest stage: the largest stage forward of the cycle (the compute a perfect pipeline would cost);
- draft: the PDM's draft time of the cycle;
- overhead: `wall - max(slowest stage, draft)`, the part of the cycle that nothing overlaps.

The second form prints the markdown table of any number of such files, the median per (label, n), and
draws it as stacked bars: on a shared machine, interleave runs of the versions being compared and let
the medians speak. The drafter is `artifacts/tiny_run/drafter` when it exists (a trained one), else a
random-init PDM with the tiny config's shape (`L_s = max(1, L/n - 1)`), which is almost always rejected;
`--replay oracle` (or an R/W pattern such as `RRRW`) replays the target's own greedy continuation
instead, at zero draft cost, for the accept-heavy regime.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference.cycle.ar import ar_decode, target_eos  # noqa: E402
from inference.cycle.schedule import eos_set  # noqa: E402
from inference.cycle.verify import Sampling  # noqa: E402
from inference.evaluation.tables import fmt, markdown_table, pyplot, save  # noqa: E402
from inference.processes.job import DecodeJob, Replay
from inference.processes.launch import launch  # noqa: E402
from inference.prompts import load_tokenizer, read_prompts, render  # noqa: E402
from spd_lightning.export import (  # noqa: E402
    DrafterSpec,
    read_drafter_spec,  # noqa: E402
    save_drafter,
)
from spd_lightning.geometry import Geometry  # noqa: E402
from spd_lightning.target import Target  # noqa: E402
from spd_lightning.testing import target_shaped_pdm  # noqa: E402

TRAINED = "artifacts/tiny_run/drafter"


def random_drafter(target: Target, n: int, out_dir: str, draft_vocab: int = 2048, seed: int = 0) -> str:
    """A random-init PDM shaped like configs/tiny.yaml's, exported like a trained one."""
    geometry = Geometry.build(target.num_layers, n)
    torch.manual_seed(seed)
    d2t = torch.randperm(target.vocab_size)[: min(draft_vocab, target.vocab_size)].sort().values
    pdm = target_shaped_pdm(target.config, geometry, max(1, target.num_layers // n - 1), d2t=d2t)
    return save_drafter(pdm, DrafterSpec(pdm.cfg, geometry, target.info), out_dir)


def profile(results) -> dict:
    """Per-cycle means over every cycle of every prompt (seconds)."""
    wall, slowest, draft = [], [], []
    for r in results:
        c = r.timing["per_cycle"]
        wall += c["wall_s"]
        draft += c["draft_s"]
        slowest += [max(row) for row in c["stage_compute_s"]]
    K = len(wall)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    overhead = [w - max(s, d) for w, s, d in zip(wall, slowest, draft)]
    N = sum(r.N for r in results)
    decode_s = sum(r.decode_s for r in results)
    return {
        "K": K,
        "N": N,
        "alpha": N / K,
        "wall_ms": 1e3 * mean(wall),
        "slowest_stage_ms": 1e3 * mean(slowest),
        "draft_ms": 1e3 * mean(draft),
        "overhead_ms": 1e3 * mean(overhead),
        "decode_tok_s": sum(r.N - 1 for r in results) / decode_s,
    }


def median_profile(profiles: list[dict]) -> dict:
    return {k: sorted(p[k] for p in profiles)[len(profiles) // 2] for k in profiles[0]}


def table(rows: dict[tuple[str, str], dict]) -> str:
    head = [
        "drafter",
        "run",
        "n",
        "K",
        "alpha",
        "cycle wall (ms)",
        "slowest stage (ms)",
        "PDM draft (ms)",
        "overhead (ms)",
        "decode tok/s",
    ]
    cells = [
        [
            drafter,
            label,
            n,
            str(p["K"]),
            fmt(p["alpha"]),
            fmt(p["wall_ms"], 2),
            fmt(p["slowest_stage_ms"], 2),
            fmt(p["draft_ms"], 2),
            fmt(p["overhead_ms"], 2),
            fmt(p["decode_tok_s"], 1),
        ]
        for (drafter, label), by_n in rows.items()
        for n, p in sorted(by_n.items(), key=lambda kv: int(kv[0]))
    ]
    return "\n".join(markdown_table(head, cells))


def plot(rows: dict[tuple[str, str], dict], path: str) -> None:
    """One panel per drafter, one stacked bar per (n, run): slowest stage, the draft's excess over it, and
    the overhead."""
    drafters = list(dict.fromkeys(d for d, _ in rows))
    fig, axes = pyplot().subplots(1, len(drafters), figsize=(5.5 * len(drafters), 4.2), squeeze=False)
    for ax, drafter in zip(axes[0], drafters):
        labels, stage, excess, overhead = [], [], [], []
        runs = {label: by_n for (d, label), by_n in rows.items() if d == drafter}
        for n in sorted({n for by_n in runs.values() for n in by_n}, key=int):
            for label, by_n in runs.items():
                if n in by_n:
                    p = by_n[n]
                    labels.append(f"n={n}\n{label.split(':')[0]}")
                    stage.append(p["slowest_stage_ms"])
                    excess.append(max(0.0, p["draft_ms"] - p["slowest_stage_ms"]))
                    overhead.append(max(0.0, p["wall_ms"] - max(p["slowest_stage_ms"], p["draft_ms"])))
        x = range(len(labels))
        ax.bar(x, stage, label="slowest stage")
        ax.bar(x, excess, bottom=stage, label="PDM draft beyond the slowest stage")
        ax.bar(x, overhead, bottom=[a + b for a, b in zip(stage, excess)], label="overhead nothing overlaps")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("ms per cycle")
        ax.set_title(drafter)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Pipeline cycle profile (CPU, gloo)")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save(fig, path)


def measure(args) -> dict:
    target = Target.load(args.target, "float32", "cpu")
    tokenizer = load_tokenizer(args.target)
    prompts = [render(tokenizer, t) for t in read_prompts(None, args.prompts)]
    eos = sorted(eos_set(target_eos(target.config)))
    drafter = args.drafter or (TRAINED if os.path.isdir(TRAINED) else None)
    replay = None
    if args.replay:
        drafter = f"replay {args.replay}"
        replay = Replay(
            args.replay, [ar_decode(target, ids, args.max_new_tokens, eos_token_id=eos).tokens for ids in prompts]
        )
    profiles = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.n:
            path, geometry = None, Geometry.build(target.num_layers, n)
            if replay is None:
                path, trained = drafter, read_drafter_spec(drafter)[0].geometry if drafter else None
                if trained is not None and trained.n == n:
                    geometry = trained
                else:  # a trained drafter serves only its own n
                    path = random_drafter(target, n, os.path.join(tmp, f"pdm_n{n}"))
            job = DecodeJob(
                args.target,
                geometry,
                prompts,
                args.max_new_tokens,
                eos,
                target.vocab_size,
                target.hidden_size,
                Sampling(),
                drafter_path=path,
                replay=replay,
                profile=True,
                pdm_placement=args.pdm_placement,
            )
            warm = dataclasses.replace(
                job,
                prompts=prompts[:1],
                max_new_tokens=8,
                replay=None if replay is None else replay._replace(references=replay.references[:1]),
            )
            launch(warm)  # the fork server, imports and first-touch allocations
            profiles[str(n)] = median_profile([profile(launch(job)) for _ in range(args.repeat)])
    meta = {
        "label": args.label,
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core CPU, gloo",
        "load_average": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "target": args.target,
        "drafter": drafter or "random-init PDM",
        "pdm_placement": args.pdm_placement,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeat": args.repeat,
    }
    return {"meta": meta, "profiles": profiles}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="artifacts/tiny_target")
    p.add_argument(
        "--drafter", default=None, help=f"exported drafter (default: {TRAINED} if present, else random-init)"
    )
    p.add_argument("--prompts", default="docs/demo_prompts.jsonl")
    p.add_argument("--n", type=int, nargs="+", default=[2, 4])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--replay", help="replay drafter policy instead of a PDM: oracle, adversary or an R/W pattern")
    p.add_argument(
        "--pdm-placement",
        choices=["separate", "shared"],
        default="separate",
        help="shared: the PDM in stage 1's process (n processes); separate: its own (n + 1)",
    )
    p.add_argument("--repeat", type=int, default=1, help="measured runs per configuration (median kept)")
    p.add_argument("--label", default="this run", help="the row label (e.g. the version measured)")
    p.add_argument("--json", dest="json_out", help="write the profile here")
    p.add_argument("--table", nargs="+", metavar="JSON", help="no measuring: the median table of these files")
    p.add_argument("--png", help="stacked-bar chart of the table")
    args = p.parse_args(argv)

    runs = []
    if args.table:
        for path in args.table:
            with open(path) as f:
                runs.append(json.load(f))
    else:
        runs.append(measure(args))
        if args.json_out:
            os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
            with open(args.json_out, "w") as f:
                json.dump(runs[0], f, indent=1)
    grouped: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for run in runs:
        key = (run["meta"]["drafter"], run["meta"]["label"])
        for n, prof in run["profiles"].items():
            grouped.setdefault(key, {}).setdefault(n, []).append(prof)
    rows = {
        key: {n: median_profile(ps) for n, ps in by_n.items()}
        for key, by_n in sorted(grouped.items(), key=lambda kv: kv[0][0])
    }  # by drafter, runs as given
    meta = runs[0]["meta"]
    count = max(len(ps) for by_n in grouped.values() for ps in by_n.values())
    print(
        f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, {meta['prompts']} prompts "
        f"x {meta['max_new_tokens']} new tokens (greedy), median of {count} run(s) per row\n"
    )
    print(table(rows))
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
