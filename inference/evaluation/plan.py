"""`python -m inference.plan`: predict SPD's wall-clock speedup for each (n, L_s) and recommend one.

    python -m inference.plan --target Qwen3.5-4B-dir --alpha 8:3:0.42 --alpha 4:4:0.66 --alpha 8:2:0.38
    python -m inference.plan --times eval_out/eval.json --alphas sweep.json --plot plan.png --json plan.json
    python -m inference.plan --layers 32 --t-full 0.0172 --t-draft 0.00349 --draft-layers 3 --overhead 0.0012 \\
        --alpha 8:3:0.42

The model (docs/DESIGN.md, "Speedup formulas", "Reference numbers"). Batch-1 decoding; one SPD cycle emits `alpha` verified tokens on average
(`alpha = N / K`, measured by `inference.eval` or the staircase evaluation for each (n, L_s)):

    T_full        one full forward of the target (AR per-token decode time)
    stage(n)      = T_full / n + stage_fixed           (the L layers split evenly over n stages, plus what a
                                                        stage pays per step whatever its share: launch, norms,
                                                        the activation hop; measured, 0 in the config-only model)
    draft(L_s)    = draft_fixed + L_s * t_draft_layer  (the PDM's per-cycle draft time grows with L_s)
    cycle         = max(stage, draft) + overhead        (pre-step SPD: drafting overlaps the stages)
                  = stage + draft + overhead            (--schedule post_step, PPSD: drafting is serial)
    tokens/s SPD  = alpha / cycle,    tokens/s AR = 1 / T_full
    speedup       = alpha * T_full / cycle

With zero draft cost and overhead the pre-step speedup is `S0 = n * alpha`; with overhead 0 it is, by docs/DESIGN.md, "Speedup formulas",
`S_spd = n*alpha*min(1, 1/(n*r))` and, post-step, `S_post = n*alpha/(1 + n*r)`, with `r = draft/T_full`.

Times come from one of:
- measured (`--times eval.json` from `inference.eval`, which holds T_full, the draft time at its L_s, the
  slowest stage at its n and the per-cycle overhead; or the flags `--t-full`, `--t-draft` at
  `--draft-layers`, `--overhead`, `--stage-fixed`, in seconds); `t_draft_layer = (t_draft - draft_fixed) /
  draft_layers` and `stage_fixed = max(0, slowest_stage - T_full / n)` at the measured n;
- a target config only (`--target` HF dir or name, or `--layers L --hidden-size H`): times in units of one
  target layer's forward, `T_full = L`, a PDM layer costs `(pdm_hidden / H)^2` target layers
  (`--pdm-hidden`, default H: the PDM layer is a target-sized decoder layer), and the overhead is
  `--overhead-layers` (default 1.0: the paper's 4B run (docs/DESIGN.md, "Reference numbers") has ~1.2 ms overhead at ~1.05 ms per target layer).
  Only ratios matter for the speedup, so no absolute time is needed.

EAGLE-3 beside SPD (`--times eval.json` of an eval with EAGLE-3 rows): its predicted speedup per k from its
measured draft-step and verify costs, beside SPD's best prediction at each n (`inference/evaluation/eagle3_plan.py`).
An eval with only an EAGLE-3 drafter needs no alpha.

Batched decoding (`--batch-times batch_times.json` of `scripts/bench_batch.py --json`): tokens/s in total and
per request at each measured B from the stage and draft step times at that B, and their weight-bound GPU reading
(`inference/evaluation/batch_plan.py`); `--batch-alpha` overrides the measured tokens per cycle.

Flags override the JSON; a value of the JSON that a flag does not override must be a finite number > 0 (overheads
>= 0; n, L, L_s and k integers >= 1), else one error line names it (a hand-edited eval.json). The recommendation is the (n, L_s) with the highest predicted speedup among
those with an alpha (n must be <= L). Writes a markdown table to stdout and a plot (`--plot`, default
plan.png); `--json` writes every row. Exit status 0, 2 on bad input (one line on stderr),
1 on anything else (`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import asdict, dataclass

from inference import cli
from inference.evaluation import costs
from inference.evaluation.batch_plan import batch_markdown, batch_rows
from inference.evaluation.eagle3_plan import eagle3_markdown, eagle3_rows
from inference.evaluation.tables import markdown_table, pyplot, save
from spd_lightning.errors import UsageError, first_line

log = logging.getLogger("inference")


@dataclass(frozen=True)
class CostModel:
    t_full: float  # seconds (or target-layer units)
    t_draft_layer: float
    draft_fixed: float = 0.0
    overhead: float = 0.0
    schedule: str = "pre_step"  # pre_step | post_step
    stage_fixed: float = 0.0
    unit: str = "s"
    num_layers: int | None = None

    def stage(self, n: int) -> float:
        return self.t_full / n + self.stage_fixed

    def draft(self, L_s: int) -> float:
        return self.draft_fixed + L_s * self.t_draft_layer

    def predict(self, n: int, L_s: int, alpha: float) -> dict:
        stage, draft = self.stage(n), self.draft(L_s)
        cycle = costs.cycle(stage, draft, self.overhead, self.schedule)
        return {
            "n": n,
            "L_s": L_s,
            "alpha": alpha,
            "S0": n * alpha,
            "stage": stage,
            "draft": draft,
            "overhead": self.overhead,
            "cycle": cycle,
            "r": draft / self.t_full,
            "draft_bound": draft > stage,
            "spd_tokens_per_unit": alpha / cycle,
            "ar_tokens_per_unit": 1.0 / self.t_full,
            "speedup": alpha * self.t_full / cycle,
        }


def plan(model: CostModel, alphas: dict[tuple[int, int], float]) -> tuple[list[dict], dict]:
    """Rows sorted by predicted speedup (best first) and the recommended row."""
    if not alphas:
        raise UsageError("no alpha given: pass --alpha N:L_S:ALPHA or --alphas FILE")
    rows = []
    for (n, L_s), alpha in alphas.items():
        if model.num_layers is not None and n > model.num_layers:
            raise UsageError(f"n={n} stages exceed the target's L={model.num_layers} layers")
        rows.append(model.predict(n, L_s, alpha))
    rows.sort(key=lambda r: (-r["speedup"], r["n"], r["L_s"]))
    return rows, rows[0]


def parse_alpha(spec: str) -> tuple[tuple[int, int], float]:
    try:
        n, L_s, alpha = spec.split(":")
        key, value = (int(n), int(L_s)), float(alpha)
    except ValueError as e:
        raise UsageError(f"--alpha {spec!r}: expected N:L_S:ALPHA, e.g. 8:3:0.42") from e
    return _check_alpha(key, value, f"--alpha {spec!r}")


def _check_alpha(key: tuple[int, int], alpha: float, where: str) -> tuple[tuple[int, int], float]:
    n, L_s = key
    if n < 1 or L_s < 1:
        raise UsageError(f"{where}: n={n} and L_s={L_s} must be >= 1")
    if not (0 < alpha <= 1):
        raise UsageError(f"{where}: alpha={alpha} must be in (0, 1] (alpha = N / K)")
    return key, alpha


def read_alphas(path: str) -> dict[tuple[int, int], float]:
    """`{"8,3": 0.42, ...}`, `[{"n": 8, "L_s": 3, "alpha": 0.42}, ...]`, or an `inference.eval` eval.json."""
    data = _read_json(path)
    out: dict[tuple[int, int], float] = {}
    try:
        if isinstance(data, dict) and "plan_inputs" in data:
            data = [data["plan_inputs"]]
        if isinstance(data, dict):
            for k, v in data.items():
                n, L_s = (int(x) for x in str(k).replace(":", ",").split(","))
                out.update([_check_alpha((n, L_s), float(v), f"{path}: {k!r}")])
        elif isinstance(data, list):
            for i, row in enumerate(data):
                out.update([_check_alpha((int(row["n"]), int(row["L_s"])), float(row["alpha"]), f"{path}[{i}]")])
        else:
            raise TypeError(type(data).__name__)
    except UsageError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(
            f'{path}: expected {{"n,L_s": alpha}} or [{{"n", "L_s", "alpha"}}] ({type(e).__name__}: {e})'
        ) from e
    return out


def _read_json(path: str):
    if not os.path.isfile(path):
        raise UsageError(f"{path!r} does not exist")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not JSON ({e})") from e
    except OSError as e:
        raise UsageError(f"cannot read {path!r}: {e.strerror or e}") from e


def target_shape(name_or_path: str) -> tuple[int, int]:
    """(L, hidden size) from an HF config directory or name."""
    from spd_lightning.target import TargetError, load_hf_config

    try:
        cfg = load_hf_config(name_or_path)
    except (TargetError, OSError, ValueError) as e:
        raise UsageError(f"cannot read the config of target {name_or_path!r}: {first_line(e)[:160]}") from e
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(cfg.num_hidden_layers), int(cfg.hidden_size)


def _check_cost_args(args: argparse.Namespace) -> None:
    for name in ("t_full", "t_draft", "draft_fixed", "overhead", "overhead_layers", "pdm_hidden", "stage_fixed"):
        x, zero_ok = getattr(args, name), name in ("draft_fixed", "overhead", "overhead_layers", "stage_fixed")
        if x is not None and (not math.isfinite(x) or x < 0 or (x == 0 and not zero_ok)):
            raise UsageError(f"--{name.replace('_', '-')}={x} must be {'>= 0' if zero_ok else '> 0'}")
    for name in ("layers", "hidden_size", "draft_layers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')}={v} must be >= 1")


def cost_model(args: argparse.Namespace, measured: dict | None) -> CostModel:
    """The cost model of the command line: measured seconds (`measured`, the `plan_inputs` of `--times eval.json`,
    or `--t-full ...`) or, without times, target layers as the unit."""
    _check_cost_args(args)
    if not isinstance(measured, dict):
        raise UsageError(f"{args.times}: no plan_inputs (expected an eval.json from inference.eval)")

    def read(key: str, flag: str, integer: bool = False, zero_ok: bool = False):  # a value the flags did not override
        fix = f"rerun inference.eval to write it again, or pass {flag}"
        return costs.measured_value(measured.get(key), f"{args.times}: plan_inputs.{key}", fix, integer, zero_ok)

    t_full = args.t_full if args.t_full is not None else read("T_full_s", "--t-full")
    shape = target_shape(args.target) if args.target else (read("L", "--layers", integer=True), None)  # over the eval's
    layers = args.layers if args.layers is not None else shape[0]
    draft_fixed = args.draft_fixed or 0.0
    if t_full is not None:  # measured times
        t_draft = args.t_draft if args.t_draft is not None else read("T_draft_s", "--t-draft")
        draft_layers = args.draft_layers if args.draft_layers is not None else read("L_s", "--draft-layers", True)
        overhead = (
            args.overhead if args.overhead is not None else (read("overhead_s", "--overhead", zero_ok=True) or 0.0)
        )
        if t_draft is None or draft_layers is None:
            raise UsageError(
                "measured times need the draft time too: --t-draft SECONDS --draft-layers L_S (or --times eval.json)"
            )
        if t_draft <= draft_fixed:
            raise UsageError(f"--draft-fixed={draft_fixed} must be below the measured draft time {t_draft}")
        per_layer, unit = (t_draft - draft_fixed) / draft_layers, "s"
        stage_fixed = args.stage_fixed
        if stage_fixed is None:  # the slowest stage's cost beyond its share T_full / n, as measured (0 if not)
            slowest, n = read("slowest_stage_s", "--stage-fixed"), read("n", "--stage-fixed", integer=True)
            stage_fixed = max(0.0, slowest - t_full / n) if slowest is not None and n else 0.0
    else:  # a target config only: one target layer's forward is the unit
        if any(x is not None for x in (args.t_draft, args.draft_fixed, args.overhead, args.stage_fixed)):
            raise UsageError(
                "--t-draft/--draft-fixed/--overhead/--stage-fixed are seconds and need --t-full (or --times eval.json)"
            )
        if layers is None:
            raise UsageError(
                "no target shape or times: pass --target DIR|NAME, --layers L [--hidden-size H], "
                "--times eval.json, or --t-full/--t-draft/--draft-layers"
            )
        hidden = args.hidden_size or shape[1]
        per_layer = (args.pdm_hidden / hidden) ** 2 if args.pdm_hidden and hidden else 1.0
        t_full, unit, overhead, stage_fixed = float(layers), "target layers", args.overhead_layers, 0.0
    return CostModel(t_full, per_layer, draft_fixed, overhead, args.schedule, stage_fixed, unit, layers)


def markdown(model: CostModel, rows: list[dict], best: dict) -> str:
    head = ["n", "L_s", "alpha", "S0 = n*alpha", "stage", "draft", "cycle", "r", "bound", "predicted speedup"]
    cells = [
        [
            str(r["n"]),
            str(r["L_s"]),
            f"{r['alpha']:.3f}",
            f"{r['S0']:.2f}",
            f"{r['stage']:.4g}",
            f"{r['draft']:.4g}",
            f"{r['cycle']:.4g}",
            f"{r['r']:.3f}",
            "draft" if r["draft_bound"] else "stage",
            f"{r['speedup']:.2f}" + (" **(recommended)**" if r is best else ""),
        ]
        for r in rows
    ]
    title = (
        f"SPD plan ({model.schedule}; times in {model.unit}; T_full={model.t_full:.4g}, stage fixed={model.stage_fixed:.4g}, "
        f"draft/layer={model.t_draft_layer:.4g}, draft fixed={model.draft_fixed:.4g}, overhead={model.overhead:.4g})"
    )
    lines = [
        title,
        "",
        *markdown_table(head, cells),
        "",
        f"recommended: n={best['n']} L_s={best['L_s']} (predicted {best['speedup']:.2f}x over AR, S0 {best['S0']:.2f})",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], best: dict, path: str) -> None:
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for L_s in sorted({r["L_s"] for r in rows}):
        pts = sorted((r["n"], r["speedup"], r["S0"]) for r in rows if r["L_s"] == L_s)
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"L_s={L_s} predicted")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], ls=":", color=line.get_color(), label=f"L_s={L_s} S0")
    ax.scatter([best["n"]], [best["speedup"]], s=160, facecolors="none", edgecolors="red", label="recommended")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("n (stages)")
    ax.set_ylabel("speedup over AR")
    ax.legend(fontsize=7)
    save(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser("python -m inference.plan", __doc__)
    p.add_argument("--target", help="HF config directory or name: L and hidden size")
    p.add_argument("--layers", type=int, help="L (overrides the target's)")
    p.add_argument("--hidden-size", type=int, help="the target's hidden size (overrides the target's)")
    p.add_argument("--pdm-hidden", type=float, help="the PDM's hidden size (config-only model; default: the target's)")
    p.add_argument(
        "--overhead-layers", type=float, default=1.0, help="config-only model: per-cycle overhead in target layers"
    )
    p.add_argument("--times", help="eval.json from inference.eval: measured T_full, draft time, overhead")
    p.add_argument("--t-full", type=float, help="seconds per full target forward (AR per-token decode)")
    p.add_argument("--t-draft", type=float, help="seconds per cycle of drafting, measured at --draft-layers")
    p.add_argument("--draft-layers", type=int, help="the L_s at which --t-draft was measured")
    p.add_argument("--draft-fixed", type=float, help="part of the draft time that does not grow with L_s (default 0)")
    p.add_argument("--overhead", type=float, help="seconds per cycle nothing overlaps (verify, communication, control)")
    p.add_argument(
        "--stage-fixed",
        type=float,
        help="seconds a stage costs per step beyond T_full / n (default: from --times, else 0)",
    )
    p.add_argument("--alpha", action="append", default=[], help="N:L_S:ALPHA, repeatable")
    p.add_argument("--alphas", help='JSON: {"n,L_s": alpha}, [{n, L_s, alpha}], or an eval.json')
    p.add_argument("--schedule", choices=["pre_step", "post_step"], default="pre_step")
    p.add_argument("--batch-times", help="JSON of scripts/bench_batch.py --json: step times per batch size B")
    p.add_argument("--batch-alpha", type=float, help="tokens per cycle of one sequence (default: the bench's)")
    p.add_argument(
        "--plot",
        help="plot of the SPD plan, its extension the format (png, pdf, svg, ...; default plan.png; '' for none)",
    )
    p.add_argument("--json", dest="json_out", help="write the rows and the recommendation here")
    cli.add_debug_argument(p)
    return p.parse_args(argv)


def _check_plot_path(path: str) -> None:
    """A format matplotlib can write (`plan.txt` would fail in `savefig`); no extension writes a png."""
    from matplotlib.backend_bases import FigureCanvasBase

    extension = os.path.splitext(path)[1].lstrip(".").lower()
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if extension and extension not in formats:
        raise UsageError(f"--plot {path!r}: matplotlib cannot write .{extension}; end it with one of {formats}")


def run(args: argparse.Namespace) -> dict:
    plot_path = "plan.png" if args.plot is None else args.plot
    if plot_path:
        _check_plot_path(plot_path)
    if args.batch_alpha is not None and not args.batch_times:
        raise UsageError("--batch-alpha sets the batch plan's tokens per cycle: it needs --batch-times")
    alphas = read_alphas(args.alphas) if args.alphas else {}
    for spec in args.alpha:
        alphas.update([parse_alpha(spec)])
    times = _read_json(args.times) if args.times else {"plan_inputs": {}}
    times = times if isinstance(times, dict) else {}
    eagle3_inputs = times.get("plan_inputs_eagle3") or []
    result: dict = {"rows": [], "markdown": ""}
    sections = []  # the markdown of each part
    if alphas or not (eagle3_inputs or args.batch_times):  # SPD's plan (EAGLE-3 or batch rows alone need no alpha)
        model = cost_model(args, times.get("plan_inputs"))
        rows, best = plan(model, alphas)
        if plot_path:
            with cli.writing(plot_path):
                plot(rows, best, plot_path)
        result = {
            "model": asdict(model),
            "rows": rows,
            "recommended": {"n": best["n"], "L_s": best["L_s"], "speedup": best["speedup"]},
            "markdown": "",
        }
        sections.append(markdown(model, rows, best))
    elif args.plot:  # asked for, but only EAGLE-3 or batch rows: nothing it plots
        log.warning("--plot %s not written: it plots the SPD plan, which needs alphas (--alpha, --alphas)", args.plot)
    if eagle3_inputs:
        result["eagle3"] = eagle3_rows(eagle3_inputs, args.t_full, args.times)
        sections.append(eagle3_markdown(result["eagle3"], result["rows"]))
    if args.batch_times:
        report = _read_json(args.batch_times)
        result["batch"] = batch_rows(report, args.batch_alpha, args.schedule, args.batch_times)
        sections.append(batch_markdown(report, result["batch"], args.schedule))
    result["markdown"] = "\n".join(sections)
    if args.json_out:
        with cli.writing(args.json_out), open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def finish(args: argparse.Namespace, result: dict) -> int:
    print(result["markdown"], end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, parse_args, run, finish)
