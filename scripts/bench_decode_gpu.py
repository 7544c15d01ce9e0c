"""Decoder latencies on one device: stage forward, PDM draft and the simulator's non-stage time, eager vs
captured (`torch.compile`: CUDA graphs on a GPU), and the planner's predicted multi-GPU speedup from them.

    python scripts/bench_decode_gpu.py --json runs/decode_gpu.json --md runs/decode_gpu.md
    python scripts/bench_decode_gpu.py --models 4b --n 8 --draft-layers 1 3     # a quicker subset

Every (model, n) compiles two stage graphs and every (model, L_s) one draft graph (tens of seconds each
on a GPU): size the subset to the time at hand.
    python scripts/bench_decode_gpu.py --tiny --device cpu --no-compile          # the smoke run (seconds)

Random-init Qwen3.5 targets with the 4B / 9B text shapes (`SHAPES`, bf16 on cuda): for each n only the
layers two stages need are built (`2 L/n`: stage 1 = embedding + `L/n` layers, stage 2 = `L/n` layers +
final norm + LM head, the slowest stage), prefilled with `--context` tokens, then timed on one decoded
token per call followed by the rollback of it (what a rejected cycle costs; a stage's per-cycle work). The
PDM (`L_s` layers of the target's width, the geometry's anchor types, `--draft-vocab` ids) is timed on a
full pipeline's draft at the largest n (fill n; the planner's draft cost does not depend on n), and the simulator (one layer per stage, eager, timing on) gives the time
per cycle that is neither a stage nor the draft. Device times are CUDA events (medians); on the CPU
`perf_counter`. `weights_ms` is the weight bytes a stage's step reads (one row of the embedding, all of the LM
head) / `--hbm-tbps`: a batch-1 decode step cannot beat it. The planner (`inference.evaluation.plan.CostModel`)
turns the numbers into predicted speedups for `--alpha` (default: the paper's 4B alphas).

Output: one JSON (`--json`) and a markdown table (stdout, and `--md`). Every stage and draft row carries
`cuda_graphs` (whether the compiled step's graphs run as CUDA graphs: False when eager, off a GPU, or when
inductor skipped them) and `cuda_graphs_skip` (why not). `--rows FILE` also appends every row to FILE (JSON
lines with a `kind`) the moment it is measured, as the GPU check's `rows.jsonl` (`scripts/gpu_check.py`
runs this script into its own): `decode_stage`, `decode_draft`, `decode_simulator`, and `decode_cycle`, one
per planner row: ms per cycle, stage and draft ms, and whether every step it is built from ran as CUDA
graphs, with the skip reason of each step that did not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference.cycle.simulator import Simulator  # noqa: E402
from inference.evaluation.plan import CostModel, parse_alpha, plan  # noqa: E402
from inference.evaluation.tables import fmt, markdown_table  # noqa: E402
from inference.runtime.capture import CompiledStep  # noqa: E402
from inference.runtime.drafter import PDMDrafter  # noqa: E402
from inference.runtime.stages import Stage  # noqa: E402
from spd_lightning.archs import load_arch  # noqa: E402
from spd_lightning.geometry import Geometry  # noqa: E402
from spd_lightning.pdm import PDMConfig, PipelineDraftModule  # noqa: E402
from spd_lightning.target import Target  # noqa: E402

log = logging.getLogger("bench_decode_gpu")

# The real Qwen3.5 text shapes (spd_lightning/archs: hybrid, 3 Gated DeltaNet layers then one full attention).
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "full_attention_interval",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)


def arch_shape(name: str) -> dict:
    config = load_arch(name)["config"]
    return {key: config[key] for key in SHAPE_KEYS}


SHAPES = {
    "4b": arch_shape("qwen3.5-4b"),
    "9b": arch_shape("qwen3.5-9b"),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        vocab_size=512,
        num_hidden_layers=8,
        full_attention_interval=2,
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["4b", "9b"], choices=["4b", "9b"])
    p.add_argument("--tiny", action="store_true", help="the tiny shape only (a smoke run)")
    p.add_argument("--n", nargs="+", type=int, default=[4, 8])
    p.add_argument("--draft-layers", nargs="+", type=int, default=[1, 2, 3, 4], help="L_s values")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sim-tokens", type=int, default=32, help="tokens the simulator decodes per n")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the captured (torch.compile) steps",
    )
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for weights_ms (H200: 4.8)")
    p.add_argument("--alpha", action="append", default=None, help="N:L_S:ALPHA for the planner (repeatable)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--rows", help="append every row to this JSON-lines file as it is measured")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.n = ["tiny"], [n for n in args.n if n <= 4] or [2]
        args.context, args.draft_vocab = min(args.context, 16), min(args.draft_vocab, 64)
        args.iters, args.warmup, args.sim_tokens = min(args.iters, 3), min(args.warmup, 1), min(args.sim_tokens, 8)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    args.alpha = args.alpha or ["8:3:0.42", "4:4:0.66"]
    return args


def median_ms(call, iters: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of `call()`: CUDA events per call, read after the loop (one synchronize)."""
    for _ in range(warmup):
        call()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return float(np.median([s.elapsed_time(e) for s, e in events]))


def emit(path: str | None, kind: str, row: dict) -> None:
    """Append one measured row to the JSON-lines file `path` now (a run cut short keeps it)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, **row}, default=str) + "\n")


def make_target(shape: dict, layers: int, device: torch.device, dtype: torch.dtype) -> Target:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**shape, "num_hidden_layers": layers}, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(dtype).eval()
    return Target(model, f"random-qwen3.5-{layers}l")


def cuda_graphs(step) -> dict:
    """Whether a compiled step's graphs run as CUDA graphs (`CompiledStep.cuda_graphs`; False when eager) and,
    when not, why: the GPU check prints it per step."""
    if not isinstance(step, CompiledStep):
        return {"cuda_graphs": False, "cuda_graphs_skip": "eager"}
    return {"cuda_graphs": bool(step.cuda_graphs), "cuda_graphs_skip": step.skip_reason}


def weight_bytes(stage: Stage) -> int:
    """The weight bytes one decode step reads: all of the stage's but the embedding table, of which it reads one
    row (a tied LM head, read whole, still counts)."""
    ids = lambda module: {id(p) for p in module.parameters()} if module is not None else set()  # noqa: E731
    table = ids(stage.embed_tokens) - ids(stage.lm_head)
    return sum(p.numel() * p.element_size() for p in stage.parameters() if id(p) not in table)


def bench_stages(shape: dict, n: int, args, device: torch.device, on_row=None) -> list[dict]:
    """Stage 1 (embedding + L/n layers) and the last stage (L/n layers + head), eager and captured; `on_row`
    is called with each row as it is measured."""
    k = shape["num_hidden_layers"] // n
    target = make_target(shape, 2 * k, device, args.dtype)
    geometry = Geometry.build(2 * k, 2)
    P = args.context
    prompt = torch.randint(0, shape["vocab_size"], (1, P), device=device)
    rows = []
    for compiled in [False, True] if args.compile else [False]:
        stages = [Stage.from_target(target, geometry, s, compile=compiled) for s in (1, 2)]
        hidden = stages[0].prefill(0, prompt, P + 8)[0]
        stages[1].prefill(0, hidden, P + 8)
        inputs = [torch.randint(0, shape["vocab_size"], (1, 1), device=device), hidden[:, -1:].clone()]
        for stage, x, role in zip(stages, inputs, ("first", "last")):

            def one_token(stage=stage, x=x):
                stage.step(x, {0: P})
                stage.cache.rollback(0, P)

            ms = median_ms(one_token, args.iters, args.warmup, device)
            bandwidth_ms = weight_bytes(stage) / (args.hbm_tbps * 1e12) * 1e3
            log.info("stage n=%d %s captured=%s: %.3f ms", n, role, compiled, ms)
            rows.append(
                {
                    "n": n,
                    "stage": role,
                    "layers": k,
                    "captured": compiled,
                    "ms": ms,
                    "weights_ms": bandwidth_ms,
                    "vs_weights": ms / bandwidth_ms,
                    **cuda_graphs(stage._step),
                }
            )
            if on_row is not None:
                on_row(rows[-1])
    del target, stages
    return rows


def bench_draft(shape: dict, n: int, L_s: int, args, device: torch.device, on_row=None) -> list[dict]:
    """One full pipeline's draft (fill n) of an `L_s`-layer PDM, eager and captured."""
    H, L = shape["hidden_size"], shape["num_hidden_layers"]
    geometry = Geometry.build(L, n)
    cfg = PDMConfig(
        H,
        geometry.num_types,
        args.draft_vocab,
        hidden_size=H,
        num_layers=L_s,
        num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"],
        head_dim=128 if H >= 1024 else 16,
        intermediate_size=shape["intermediate_size"],
    )
    torch.manual_seed(0)
    with torch.device(device):
        pdm = PipelineDraftModule(cfg).to(args.dtype).eval()
        embed = torch.nn.Embedding(shape["vocab_size"], H).to(args.dtype)
    P = args.context
    view = [(depth, P + i) for i, depth in enumerate(range(n - 1, -1, -1))]  # pre-step: the newest at depth 0
    rows = []
    for compiled in [False, True] if args.compile else [False]:
        drafter = PDMDrafter(pdm, geometry, embed, args.dtype, 1, compile=compiled)
        drafter.start(0, torch.randint(0, shape["vocab_size"], (1, P), device=device), P + n + 2)
        drafter.states.normal_()
        draft = lambda: drafter.draft({0: view})  # noqa: B023, E731 - timed here
        draft()  # appends the prompt: later calls draft the in-flight positions only
        ms = median_ms(draft, args.iters, args.warmup, device)
        log.info("draft L_s=%d fill=%d captured=%s: %.3f ms", L_s, n, compiled, ms)
        rows.append({"n": n, "L_s": L_s, "fill": n, "captured": compiled, "ms": ms, **cuda_graphs(drafter._step)})
        if on_row is not None:
            on_row(rows[-1])
    return rows


def bench_simulator(shape: dict, n: int, args, device: torch.device) -> dict:
    """Per cycle of an eager simulator decode (one layer per stage): wall, stages, draft, and the rest."""
    target = make_target(shape, n, device, args.dtype)
    geometry = Geometry.build(n, n)
    cfg = PDMConfig(
        shape["hidden_size"],
        geometry.num_types,
        args.draft_vocab,
        hidden_size=shape["hidden_size"],
        num_layers=1,
        num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"],
        head_dim=128 if shape["hidden_size"] >= 1024 else 16,
        intermediate_size=shape["intermediate_size"],
    )
    with torch.device(device):
        pdm = PipelineDraftModule(cfg).to(args.dtype).eval()
    simulator = Simulator(target, pdm, geometry, profile=True)
    prompt = torch.randint(0, shape["vocab_size"], (args.context,)).tolist()
    simulator.decode(prompt, max(2, args.sim_tokens // 4))  # warm-up
    result = simulator.decode(prompt, args.sim_tokens)
    t, K = result.timing["totals"], result.K
    wall, stages, draft = t["wall_s"] / K, sum(t["stage_compute_s"]) / K, t["draft_s"] / K
    return {
        "n": n,
        "K": K,
        "wall_ms": wall * 1e3,
        "stages_ms": stages * 1e3,
        "draft_ms": draft * 1e3,
        "non_stage_ms": (wall - stages) * 1e3,
        "overhead_ms": (wall - stages - draft) * 1e3,
    }


def predict(model: str, shape: dict, stage_rows, draft_rows, sim_rows, alphas, captured: bool) -> list[dict]:
    """The planner's rows from this run's times: T_full = n stage-1 times + the head's extra, the draft line
    fitted over L_s, the overhead the simulator's."""
    out = []
    for n in sorted({r["n"] for r in stage_rows}):
        pick = {r["stage"]: r["ms"] for r in stage_rows if r["n"] == n and r["captured"] == captured}
        drafts = sorted((r["L_s"], r["ms"]) for r in draft_rows if r["captured"] == captured)
        if not pick or not drafts:
            continue
        t_full = n * pick["first"] + (pick["last"] - pick["first"])
        if len(drafts) > 1:
            slope, fixed = np.polyfit([d[0] for d in drafts], [d[1] for d in drafts], 1)
        else:
            slope, fixed = drafts[0][1] / drafts[0][0], 0.0
        overhead = next((r["overhead_ms"] for r in sim_rows if r["n"] == n), 0.0)
        cost = CostModel(
            t_full,
            max(float(slope), 1e-9),
            max(float(fixed), 0.0),
            max(overhead, 0.0),
            stage_fixed=max(0.0, pick["last"] - t_full / n),
            unit="ms",
            num_layers=shape["num_hidden_layers"],
        )
        chosen = {key: a for key, a in alphas.items() if key[0] == n}
        if not chosen:  # no alpha for this n: nothing to predict
            continue
        rows, _ = plan(cost, chosen)
        out += [{"model": model, "captured": captured, "t_full_ms": t_full, **row} for row in rows]
    return out


def cycle_row(p: dict, stage_rows: list[dict], draft_rows: list[dict]) -> dict:
    """One decode row of the GPU check from a planner row: ms per cycle, stage and draft ms, and whether the
    steps it was built from (both stages of its n, every draft the draft line was fitted over) all ran as CUDA
    graphs, with each other step's reason."""
    steps = {
        f"stage {r['stage']} n={r['n']}": r for r in stage_rows if r["n"] == p["n"] and r["captured"] == p["captured"]
    }
    steps |= {f"draft L_s={r['L_s']}": r for r in draft_rows if r["captured"] == p["captured"]}
    return {
        "model": p["model"],
        "captured": p["captured"],
        "n": p["n"],
        "L_s": p["L_s"],
        "alpha": p["alpha"],
        "cycle_ms": p["cycle"],
        "stage_ms": p["stage"],
        "draft_ms": p["draft"],
        "overhead_ms": p["overhead"],
        "speedup": p["speedup"],
        "cuda_graphs": bool(steps) and all(r["cuda_graphs"] for r in steps.values()),
        "cuda_graphs_skip": {name: r["cuda_graphs_skip"] for name, r in steps.items() if not r["cuda_graphs"]},
    }


def run(args) -> dict:
    device = torch.device(args.device)
    alphas = dict(parse_alpha(a) for a in args.alpha)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.node(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(args.dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "args": vars(args) | {"dtype": str(args.dtype)},
        "models": {},
    }
    for model in args.models:
        shape = SHAPES[model]

        def on_row(kind, model=model):
            return lambda row: emit(args.rows, kind, {"model": model, **row})

        # The draft line first (every n's plan needs it), then per n its stages, its simulator and at once its
        # cycle rows: a run cut at its time limit keeps every n it finished.
        draft_rows = [
            r
            for L_s in args.draft_layers
            for r in bench_draft(shape, max(args.n), L_s, args, device, on_row("decode_draft"))
        ]
        stage_rows, sim_rows, plans = [], [], []
        for n in args.n:
            these = bench_stages(shape, n, args, device, on_row("decode_stage"))
            stage_rows += these
            sim_rows.append(bench_simulator(shape, n, args, device))
            emit(args.rows, "decode_simulator", {"model": model, **sim_rows[-1]})
            for captured in [False, True] if args.compile else [False]:
                for p in predict(model, shape, these, draft_rows, sim_rows, alphas, captured):
                    plans.append(p)
                    emit(args.rows, "decode_cycle", cycle_row(p, stage_rows, draft_rows))
        report["models"][model] = {
            "shape": shape,
            "stages": stage_rows,
            "drafts": draft_rows,
            "simulator": sim_rows,
            "plan": plans,
        }
        write_json(report, args.json)  # after each model: a run cut short by a time limit keeps what it measured
    return report


def write_json(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)


def table(head, rows) -> str:
    return "\n".join(markdown_table(head, [[fmt(cell) for cell in row] for row in rows]))


def markdown(report: dict) -> str:
    lines = [f"Decoder latencies, {report['device']} ({report['gpu']}), {report['dtype']}, {report['date']}", ""]
    for model, r in report["models"].items():
        lines.append(f"### {model}: stage forward (one token + its rollback), ms")
        lines.append(
            table(
                ["n", "stage", "layers", "captured", "ms", "weights_ms", "vs_weights"],
                [
                    [x["n"], x["stage"], x["layers"], x["captured"], x["ms"], x["weights_ms"], x["vs_weights"]]
                    for x in r["stages"]
                ],
            )
        )
        lines.append(f"\n### {model}: PDM draft (fill n), ms")
        lines.append(
            table(["n", "L_s", "captured", "ms"], [[x["n"], x["L_s"], x["captured"], x["ms"]] for x in r["drafts"]])
        )
        lines.append(f"\n### {model}: simulator per cycle (eager), ms")
        lines.append(
            table(
                ["n", "K", "wall", "stages", "draft", "non-stage", "overhead"],
                [
                    [x["n"], x["K"], x["wall_ms"], x["stages_ms"], x["draft_ms"], x["non_stage_ms"], x["overhead_ms"]]
                    for x in r["simulator"]
                ],
            )
        )
        lines.append(f"\n### {model}: planner, predicted speedup over 1-GPU AR")
        lines.append(
            table(
                ["captured", "n", "L_s", "alpha", "stage", "draft", "overhead", "cycle", "speedup"],
                [
                    [
                        p["captured"],
                        p["n"],
                        p["L_s"],
                        p["alpha"],
                        p["stage"],
                        p["draft"],
                        p["overhead"],
                        p["cycle"],
                        p["speedup"],
                    ]
                    for p in r["plan"]
                ],
            )
        )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    with torch.no_grad():
        report = run(args)
    table = markdown(report)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
