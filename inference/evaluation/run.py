"""`python -m inference.eval`: benchmark a drafter on prompt sets (docs/DESIGN.md, "Speedup formulas"): alpha, speedups, wall-clock.

    python -m inference.eval --ckpt drafter/ --prompts ../shared/data/gsm8k_question.jsonl \\
        ../shared/data/humaneval_question.jsonl --temperatures 0 1 --limit 80 --out eval_out --simulate

For each EAGLE-style jsonl set (or dataset, see inference/prompts.py) and each temperature (T > 0
samples with `--top-k`/`--top-p`, by default top-k 50 and top-p 1.0), every prompt is decoded by the SPD
decoder (`--simulate`: the one-process simulator; otherwise the n+1-process pipeline) and by plain AR
decoding of the same target loaded in this process. Reported per set and overall (all sets pooled):

- `alpha = N / K` (pooled over prompts) and `S0 = n * alpha`;
- the cost model of inference/evaluation/costs.py, one for every method: `r` = the drafter's time per
  draft token over the AR baseline's time per token (one full target forward), per prompt in this process,
  its median over the prompts (`r_min`, `r_max`, `r_repeats` beside it); `S_spd = n*alpha*min(1, 1/(n*r))`
  (drafting masked while it fits in one stage), `S_post = S_ppsd = n*alpha / (1 + n*r)`, and `S` the
  row's own mode's; `S_gpu` the same at `r_gpu`, the r a GPU has at the paper's shapes;
- wall-clock: decode-phase tokens/s of the decoder over the AR baseline's (prefill excluded). Under
  `--simulate` the stages run in sequence, so this number is not the pipeline's. A warm-up decode of the
  longest prompt (in each launch's ranks too) keeps allocation and `--compile`'s graphs out of the times;
- `ci`: 95 % bootstrap intervals over prompts (inference/evaluation/intervals.py) of alpha, `n*alpha`, r,
  S, S_gpu and the wall-clock speedup; acceptance per depth and per fill.

EAGLE-3 beside it: `--eagle3 DRAFTER` (or an EAGLE-3 drafter as `--ckpt`) adds chain decoding at each
`--k` (default 7; e.g. `--k 3 5 7`) on the same target, prompts and AR baseline, in
`eagle3_results` (inference/evaluation/rows.py: tokens per target forward, S_eagle3, wall-clock), and a
side-by-side table of every method: tokens per target forward (`S0`: n*alpha for SPD, N/K for EAGLE-3),
the theoretical speedup with the draft cost (S_spd, S_post for post-step/PPSD, S_eagle3), the same at the
paper's GPU r, and the wall-clock speedup. More PDM drafters of the same target join the same report with `--compare CKPT ...`
(e.g. a PPSD drafter, trained with first-stage features, or another n or L_s), each decoded in its own mode
on the same prompts against the same AR decodes; their rows are in `results` beside `--ckpt`'s (each row
names its `method`, `drafter`, `mode`, `n`, `L_s`). SPD, PPSD and EAGLE-3 in one report:

    python -m inference.eval --ckpt spd_drafter/ --compare ppsd_drafter/ --eagle3 eagle3_drafter/ --k 3 5 7 \\
        --prompts set.jsonl --simulate

Writes DIR/eval.json (every number, plus what `inference.plan` reads: `plan_inputs`, `plan_inputs_eagle3`),
DIR/eval.md (markdown tables) and DIR/eval.png. Exit status: 0 done, 2 bad input (one line on stderr; `--debug` shows tracebacks),
1 an unexpected error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

from tqdm import tqdm

from inference import cli
from inference.backends import make_backend
from inference.chain.decoder import ChainDecoder
from inference.cycle.ar import ar_decode_stages, ar_stages
from inference.cycle.result import DecodeResult
from inference.evaluation.report import markdown, write_outputs
from inference.evaluation.rows import eagle3_row, pdm_row
from inference.processes.launch import launch
from inference.prompts import dataset_spec, read_prompts
from inference.sampling import Sampling
from inference.setup import Setup, check_k, decode_job, drafter_for_mode, encode_prompts, prepare
from spd_lightning.eagle3.export import KIND as EAGLE3

log = logging.getLogger("inference")

EAGER_AR = "ar_eager"  # under --compile, the AR baseline run eagerly: EAGLE-3's unit


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser("python -m inference.eval", doc=__doc__)
    p.add_argument(
        "--prompts",
        nargs="+",
        required=True,
        help="EAGLE-style jsonl sets (first turn of each line), or datasets NAME[:CONFIG][@SPLIT] (hub or local)",
    )
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="for T > 0 (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="for T > 0, in (0, 1]")
    p.add_argument("--limit", type=int, help="first K prompts of each set")
    p.add_argument("--out", default="eval_out", help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--eagle3", help="an EAGLE-3 drafter to evaluate beside --ckpt, at each --k, on the same target")
    p.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="CKPT",
        help="more PDM drafters of --ckpt's target (a PPSD drafter, another n or L_s), each in its own mode, "
        "on the same prompts and AR decodes",
    )
    cli.add_decoder_arguments(p, max_new_tokens=512, with_ar=False, k_values=True)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[Sampling]:
    cli.check_decoder_args(args)
    if args.limit is not None and args.limit < 1:
        raise cli.UsageError(f"--limit={args.limit} must be >= 1")
    if len(set(args.temperatures)) != len(args.temperatures):
        raise cli.UsageError(f"--temperatures {args.temperatures} repeats a value")
    return [Sampling(t, args.top_k if t > 0 else 0, args.top_p if t > 0 else 1.0) for t in args.temperatures]


@dataclass
class PromptSet:
    name: str
    path: str
    prompts: list[list[int]]  # rendered token ids


def set_name(path: str, taken: set[str]) -> str:
    name = os.path.splitext(os.path.basename(dataset_spec(path.rstrip("/"))[0]))[0].removesuffix("_question")
    base, i = name, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def read_sets(args: argparse.Namespace, setup: Setup) -> list[PromptSet]:
    taken: set[str] = set()
    return [
        PromptSet(
            set_name(path, taken),
            path,
            encode_prompts(setup, read_prompts(None, path)[: args.limit], args.max_new_tokens),
        )
        for path in args.prompts
    ]


class PdmDecoder:
    """One PDM drafter under test on the eval's target: the simulator (`--simulate`) or the n + 1 ranks."""

    results = "results"  # the report's list of this method's rows
    baseline = "ar"  # the AR decodes its times are divided by: compiled under `--compile`, as its steps are

    def __init__(self, args: argparse.Namespace, setup: Setup, target):
        self.args, self.setup = args, setup
        self.backend = (
            make_backend(setup, args.device, target, compile=args.compile, profile=True) if args.simulate else None
        )
        self.n, self.L_s = setup.geometry.n, setup.spec.pdm.num_layers
        self.method = f"{setup.mode} n={self.n} L_s={self.L_s}"

    def row(self, results: list[DecodeResult], ar: list[DecodeResult]) -> dict:
        """This drafter's numbers on a group of prompts beside the AR decodes of the same prompts, first what
        tells its rows from another drafter's in one report."""
        mode = self.setup.mode
        identity = {"method": self.method, "drafter": self.setup.ckpt, "mode": mode, "n": self.n, "L_s": self.L_s}
        return {**identity, **pdm_row(mode, self.n, self.L_s, results, ar)}

    def warm_up(self, sampling: Sampling, prompt: list[int]) -> None:
        """The simulator's; fresh ranks warm up in each launch (`DecodeJob.warm_up`)."""
        if self.backend is not None:
            self.backend.generate(prompt, self.args.max_new_tokens, sampling, self.args.seed)

    def decode(self, sampling: Sampling, prompts: list[list[int]], progress) -> list[DecodeResult]:
        args = self.args
        if self.backend is None:
            job = decode_job(self.setup, args, prompts, sampling, profile=True, warm_up=True)
            return launch(job, on_result=lambda i, r: progress(1))
        results = []
        for i, ids in enumerate(prompts):
            results.append(self.backend.generate(ids, args.max_new_tokens, sampling, args.seed + i))
            progress(1)
        return results


class Eagle3Decoder:
    """EAGLE-3 chain decoding at one k on the eval's target (one drafter, its weights shared by every k)."""

    results = "eagle3_results"

    def __init__(self, base: ChainDecoder, k: int, args: argparse.Namespace, eos: list[int]):
        self.base, self.k, self.args, self.eos = base, k, args, eos
        # chain decoding runs eagerly: under `--compile` its unit is an eager AR forward, like with like
        self.baseline = EAGER_AR if args.compile else "ar"

    def row(self, results: list[DecodeResult], ar: list[DecodeResult]) -> dict:
        return eagle3_row(self.k, results, ar)

    def warm_up(self, sampling: Sampling, prompt: list[int]) -> None:
        self.base.variant(self.k, sampling).decode(prompt, self.args.max_new_tokens, self.eos, self.args.seed)

    def decode(self, sampling: Sampling, prompts: list[list[int]], progress) -> list[DecodeResult]:
        decoder, args, results = self.base.variant(self.k, sampling), self.args, []
        for i, ids in enumerate(prompts):
            results.append(decoder.decode(ids, args.max_new_tokens, self.eos, args.seed + i).to_decode_result())
            progress(1)
        return results


class Decoders:
    """Every drafter under test (PDM drafters, simulated or distributed; EAGLE-3 at each k), in `methods`, and
    the AR baselines, all on one target loaded once. Each method's times are divided by the AR decodes run as
    its own steps run (`baseline`): under `--compile` the PDM decoders' by a compiled AR step (T_full, the unit of
    their speedups, is the captured step's time, not the eager launch-bound one), EAGLE-3's, which has no compiled
    path, by an eager one. Each baseline's stage is built once, so its graphs serve every prompt."""

    def __init__(self, args: argparse.Namespace, setups: list[Setup], eagle3: str | None):
        from spd_lightning.target import Target

        self.args, self.setup = args, setups[0]
        self.target = Target.load(self.setup.target_path, self.setup.dtype, args.device, self.setup.trust_remote_code)
        pdms = [PdmDecoder(args, setup, self.target) for setup in setups if setup.mode != EAGLE3]
        methods = [pdm.method for pdm in pdms]
        for pdm in pdms:  # drafters of one mode, n and L_s (e.g. two layouts): named by their run
            if methods.count(pdm.method) > 1:
                pdm.method += f" ({drafter_name(pdm.setup.ckpt)})"
        self.methods: list = pdms
        self.baselines = {"ar": ar_stages(self.target, compile=args.compile)} if pdms else {}
        if eagle3:
            if args.compile:
                log.warning(
                    "--compile: EAGLE-3 runs eagerly (chain decoding has no compiled path) and is measured "
                    "against an eager AR baseline; SPD against a compiled one"
                )
            base = ChainDecoder.on_target(self.target, eagle3, max(args.k))
            self.methods += [Eagle3Decoder(base, k, args, self.setup.eos) for k in sorted(set(args.k))]
            name = self.methods[-1].baseline
            self.baselines[name] = self.baselines.get(name) or ar_stages(self.target)

    def warm_up(self, sampling: Sampling, prompt: list[int]) -> None:
        """Allocator and kernels warm and, under `--compile`, the graphs compiled and captured outside the times: a
        whole decode of the longest prompt at the measured `max_new_tokens` reserves the largest capacity bucket
        any measured decode needs (caches never shrink; graphs are keyed by capacity) and visits the fill levels."""
        for method in self.methods:
            method.warm_up(sampling, prompt)
        for stages in self.baselines.values():
            ar_decode_stages(stages, prompt, self.args.max_new_tokens, sampling, self.setup.eos, self.args.seed)

    def ar(self, sampling: Sampling, prompts: list[list[int]]) -> dict[str, list[DecodeResult]]:
        """Each AR baseline's decodes of `prompts`, by name."""
        args = self.args
        return {
            name: [
                ar_decode_stages(stages, ids, args.max_new_tokens, sampling, self.setup.eos, args.seed + i)
                for i, ids in enumerate(prompts)
            ]
            for name, stages in self.baselines.items()
        }


def drafter_name(path: str) -> str:
    """`runs/x/checkpoints/last.ckpt` -> `x`; `drafters/y/` -> `y`."""
    parts = os.path.normpath(path).split(os.sep)
    if parts[-1].endswith(".ckpt"):
        parts = parts[:-1]
    if len(parts) > 1 and parts[-1] == "checkpoints":
        parts = parts[:-1]
    return parts[-1]


def compared_setups(args: argparse.Namespace, setup: Setup) -> list[Setup]:
    """The `--compare` drafters, each in its own mode: PDM drafters of `--ckpt`'s target."""
    setups = []
    for path in args.compare:
        other = prepare(argparse.Namespace(**{**vars(args), "ckpt": path, "mode": None}))
        if other.mode == EAGLE3:
            raise cli.UsageError(f"--compare {path}: an EAGLE-3 drafter; pass it as --eagle3 (one at most)")
        if other.target_path != setup.target_path:
            raise cli.UsageError(
                f"--compare {path} drafts for {other.target_path}, --ckpt for {setup.target_path}: "
                f"compare drafters of one target (or pass --target to decode both on it)"
            )
        setups.append(other)
    return setups


def run(args: argparse.Namespace) -> dict:
    samplings = check_args(args)
    setup = prepare(args)
    if setup.mode == "ar":
        raise cli.UsageError("inference.eval compares a drafter with AR decoding: --ckpt must name a drafter")
    if setup.mode == EAGLE3 and (args.eagle3 or args.compare):  # the report's plan inputs are --ckpt's PDM rows
        raise cli.UsageError(
            "--ckpt is an EAGLE-3 drafter: pass a PDM drafter as --ckpt and the EAGLE-3 one as --eagle3 "
            "(or drop --eagle3 and --compare)"
        )
    if args.eagle3:
        drafter_for_mode(args.eagle3, EAGLE3)  # one line now if it is not an EAGLE-3 drafter
        check_k(args.k, setup.info)
    cli.warn_unused_placement(args, setup.mode)
    setups = [setup, *compared_setups(args, setup)]
    sets = read_sets(args, setup)
    with cli.writing(args.out):
        os.makedirs(args.out, exist_ok=True)
    eagle3 = setup.ckpt if setup.mode == EAGLE3 else args.eagle3
    decoders = Decoders(args, setups, eagle3)
    report = _report_head(args, setup, eagle3)
    total = len(decoders.methods) * len(samplings) * sum(len(s.prompts) for s in sets)
    bar = tqdm(total=total, unit="prompt", file=sys.stderr, disable=args.no_progress, dynamic_ncols=True)
    try:
        for sampling in samplings:
            _evaluate(decoders, sampling, sets, bar, report)
    finally:
        bar.close()
    if report["results"]:
        report["plan_inputs"] = _plan_inputs(report)
    keys = ("k", "alpha", "tau", "T_full_s", "T_draft_step_s", "T_verify_s")  # what the planner predicts EAGLE-3 from
    report["plan_inputs_eagle3"] = [{key: r[key] for key in keys} for r in _lowest_overall(report["eagle3_results"])]
    write_outputs(report, args.out)
    return report


def _report_head(args: argparse.Namespace, setup: Setup, eagle3: str | None) -> dict:
    pdm = setup.mode != EAGLE3
    return {
        "target": setup.target_path,
        "drafter": setup.ckpt,
        "mode": setup.mode,
        "n": setup.geometry.n,
        "L": setup.info.num_layers,
        "L_s": setup.spec.pdm.num_layers if pdm else None,
        "compared": args.compare,
        "eagle3_drafter": eagle3,
        "k": args.k if eagle3 else None,
        "hidden_size": setup.info.hidden_size,
        "geometry": setup.geometry.to_dict(),
        "max_new_tokens": args.max_new_tokens,
        "limit": args.limit,
        "simulate": args.simulate,
        # what ran through torch.compile (CUDA graphs on a GPU): chain decoding has no compiled path, so the AR
        # baseline EAGLE-3's rows are measured against (`eagle3_ar`) is eager too
        "compiled": {"pdm": pdm and args.compile, "ar": pdm and args.compile, "eagle3": False, "eagle3_ar": False},
        "device": args.device,
        "dtype": setup.dtype,
        "seed": args.seed,
        "results": [],
        "eagle3_results": [],
    }


def _evaluate(decoders: Decoders, sampling: Sampling, sets: list[PromptSet], bar, report: dict) -> None:
    """One row per set and one pooling every set, at one temperature, for each PDM drafter (`results`) and
    for EAGLE-3 at each k (`eagle3_results`), all against the same AR decodes."""
    decoders.warm_up(sampling, max((p for s in sets for p in s.prompts), key=len))
    pooled: dict = {**{name: [] for name in decoders.baselines}, **{method: [] for method in decoders.methods}}
    head = {"temperature": sampling.temperature, "sampling": sampling.to_dict()}
    for prompt_set in sets:
        bar.set_description(f"{prompt_set.name} T={sampling.temperature:g}")
        decoded = decoders.ar(sampling, prompt_set.prompts)
        for method in decoders.methods:
            decoded[method] = method.decode(sampling, prompt_set.prompts, bar.update)
        _add_rows(report, decoders.methods, {"set": prompt_set.name, "path": prompt_set.path, **head}, decoded)
        for key, results in decoded.items():
            pooled[key] += results
    _add_rows(report, decoders.methods, {"set": "overall", "path": None, **head}, pooled)


def _add_rows(report: dict, methods: list, where: dict, decoded: dict) -> None:
    for method in methods:
        report[method.results].append({**where, **method.row(decoded[method], decoded[method.baseline])})


def _plan_inputs(report: dict) -> dict:
    """What `inference.plan --times eval.json` reads: measured T_full, draft time at this L_s, slowest stage, overhead."""
    row = _lowest_overall([r for r in report["results"] if r["drafter"] == report["drafter"]])[0]
    overhead, draft = None, row["T_draft_s"]
    if row["mean_cycle_s"] is not None and draft is not None:
        # the simulator runs stages and drafter in sequence; the pipeline overlaps them
        busy = row["mean_stage_sum_s"] + draft if report["simulate"] else max(row["mean_slowest_stage_s"], draft)
        overhead = max(0.0, row["mean_cycle_s"] - busy)
    return {
        "T_full_s": row["T_full_s"],
        "T_draft_s": draft,
        "L_s": report["L_s"],
        "overhead_s": overhead,
        "n": report["n"],
        "alpha": row["alpha"],
        "L": report["L"],
        "slowest_stage_s": row["mean_slowest_stage_s"],
    }


def _lowest_overall(rows: list[dict]) -> list[dict]:
    """The pooled rows (every set) at the lowest temperature: what the planner reads."""
    overall = [r for r in rows if r["set"] == "overall"]
    lowest = min((r["temperature"] for r in overall), default=None)
    return [r for r in overall if r["temperature"] == lowest]


def finish(args: argparse.Namespace, report: dict) -> int:
    print(markdown(report), end="")
    print(f"wrote {os.path.join(args.out, 'eval.json')}, eval.md, eval.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, parse_args, run, finish)
