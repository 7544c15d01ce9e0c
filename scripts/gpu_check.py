"""The GPU check: one prepared run on one GPU that fails fast and always leaves numbers.

Run it on the device machine (through the session's `run` tool) from the repository root:

    bash scripts/gpu_check.sh                  # writes gpu_check/gpu_check.json and gpu_check/gpu_check.md
    python3 scripts/gpu_check.py --tiny --device cpu --out DIR   # the CPU rehearsal (tests/test_gpu_check.py)

Three sections, each a child process with a time limit of its own, in the order of what matters most when a run
is cut short:
1. the decoder at GPU speed (`scripts/bench_decode_gpu.py`, `--decode-s`): eager vs captured stage and draft
   steps, whether CUDA graphs were captured (and why not), and per planner row the ms per cycle, stage and draft
   ms, each n's cycle rows written as soon as that n is measured;
2. training and the decoder's parts on random-init Qwen3.5-4B and -9B targets of their real shapes
   (spd_lightning/archs, bf16; `--section train`, `--train-s`): training-step tokens/s, step time, peak memory
   next to `spd_lightning.estimate`'s prediction, and MFU (the estimate's FLOPs per token x tokens / step time /
   the GPU's dense bf16 peak) at T=2048, n=8, L_s=3, both layouts, with and without activation checkpointing,
   with the Gated DeltaNet kernel path of the target (`fla` kernels or the torch fallback); per-stage forward
   latency for n in {4, 8}; PDM draft latency for L_s in 1..4; a simulator greedy decode checked identical to AR;
3. the compile checks (`--section compile`, `--compile-s`): compiled flex forward and backward for both layouts
   at the shipped shape (n = 8, head_dim 256, bf16, T = 2048; on CPU the dense path stands in), and the flex block
   mask per step vs per shape.
Every row is appended to `rows.jsonl` the moment it is measured, so a child cut at its limit keeps what it
measured; gpu_check.json and gpu_check.md are built from those rows after each section. Within a section, rows
that would overrun its limit are skipped and listed. Only torch, transformers, lightning, torchmetrics, safetensors
and numpy are imported (no datasets, wandb, jsonargparse, ShareGPT), plus flash-linear-attention when the bundle
of wheels brought it (`make gpu-bundle`, docs/DESIGN.md "The GPU check").
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/bench_block_mask.py

from bench_block_mask import markdown as block_mask_markdown  # noqa: E402
from bench_block_mask import measure as block_mask_row  # noqa: E402

from inference.cycle.ar import ar_decode  # noqa: E402
from inference.cycle.simulator import simulate_decode  # noqa: E402
from inference.runtime.drafter import PDMDrafter  # noqa: E402
from inference.runtime.stages import Stage  # noqa: E402
from spd_lightning.estimate import Shape, estimate, target_config  # noqa: E402
from spd_lightning.geometry import Geometry  # noqa: E402
from spd_lightning.target import Target, deltanet_kernels  # noqa: E402
from spd_lightning.testing import RandomChats, target_shaped_pdm  # noqa: E402
from spd_lightning.training.module import SPDModule  # noqa: E402

ARCHS = {"qwen35_9b": "Qwen/Qwen3.5-9B", "qwen35_4b": "Qwen/Qwen3.5-4B"}  # the 9B first: its memory is the question
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    vocab_size=512,
)


# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by device name, from the vendors' data sheets.
BF16_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}


def bf16_peak_flops(device_name: str) -> float | None:
    return next((1e12 * tf for key, tf in BF16_PEAK_TFLOPS.items() if key in device_name), None)


def emit(out: str, kind: str, row: dict) -> None:
    """Append one measured row to rows.jsonl now (a run killed later keeps it)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "rows.jsonl"), "a") as f:
        f.write(json.dumps({"kind": kind, **row}, default=str) + "\n")


def gated_deltanet() -> str:
    """What the Gated DeltaNet layers run, as transformers' Qwen3.5 modeling bound it at import: the delta rule on
    flash-linear-attention's kernels (what `gpu_bundle/` carries) or the torch fallback, and the short convolution
    on causal-conv1d (a CUDA build, never carried) or torch, which costs little beside the delta rule."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    kernels = deltanet_kernels(modeling_qwen3_5)
    rule = "fla kernels" if kernels["flash-linear-attention"] else "torch fallback"
    return f"{rule}; short conv: {'causal-conv1d' if kernels['causal-conv1d'] else 'torch'}"


def flex_compile_check(opts, device) -> list[dict]:
    """The shipped attention path before anything else: flex (compiled on a GPU) forward and backward for both
    layouts at n, T and head_dim 256 in the run's dtype, the query rows of every copy as the checkpointed layers
    recompute them. On CPU, where flex has no backward, the dense path stands in (the smoke test)."""
    from spd_lightning.training.layouts import build_layout

    dtype = torch.bfloat16 if opts.dtype == "bfloat16" else torch.float32
    backend = "flex" if device.type == "cuda" else "dense"
    rows = []
    for name in ("depth", "type"):
        t0 = time.perf_counter()
        row = {"layout": name, "backend": backend, "n": opts.n, "length": opts.length, "head_dim": opts.head_dim}
        try:
            layout = build_layout(name, Geometry.build(32, opts.n))
            lengths = torch.full((1,), opts.length, device=device)
            rep = layout.replicate(lengths, opts.length, layout.draw_fill(1, opts.length))
            q, k, v = (
                torch.randn(1, 2, rep.seq_len, opts.head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            rep.attend(backend)(0, q, k, v).float().square().mean().backward()
            sync(device)
            row.update(ok=True, finite=bool(torch.isfinite(q.grad).all()))
        except Exception as e:  # noqa: BLE001 - the check reports any failure of the path as its result
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).strip()[:300]}")
        row["seconds"] = time.perf_counter() - t0
        emit(opts.out, "flex_compile", row)
        rows.append(row)
    return rows


DEADLINE = "GPU_CHECK_DEADLINE"  # the wall-clock instant (epoch seconds) the parent cuts a section's child


class Budget:
    """Rows that would end past `deadline` (epoch seconds) are skipped and listed."""

    def __init__(self, deadline: float):
        self.deadline, self.skipped = deadline, []

    def allows(self, what: str, needs: float) -> bool:
        if time.time() + needs > self.deadline:
            self.skipped.append(what)
            return False
        return True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_target(arch: str, opts, device: torch.device, dtype: torch.dtype) -> tuple[Target, str]:
    """A random-init target of `arch`'s architecture, and a directory holding its config (what `fit` reads)."""
    from transformers import AutoModelForCausalLM

    config = target_config(ARCHS[arch])
    if opts.tiny:
        for key, value in TINY.items():
            setattr(config, key, value)
    if opts.layers:  # fewer layers, keeping the hybrid pattern (said so in the output)
        config.num_hidden_layers = opts.layers
        config.layer_types = config.layer_types[: opts.layers]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    config_dir = tempfile.mkdtemp(prefix=f"gpu_check_{arch}_")
    config.save_pretrained(config_dir)
    return Target(model.eval(), config_dir), config_dir


class ValidatedChats(RandomChats):
    """`RandomChats` with one validation batch, so that the training run starts as `fit` does: with the sanity
    check, which on one GPU (and on NCCL) runs under inference mode; what it caches, the training steps use."""

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.train_dataloader().dataset[:1], batch_size=None)


class StepTimer(L.Callback):
    def __init__(self, device: torch.device):
        self.device, self.times, self.validated_first = device, [], 0

    def on_validation_batch_end(self, *args):
        self.validated_first += not self.times  # validation batches before the first training step

    def on_train_batch_start(self, *args):
        sync(self.device)
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, *args):
        sync(self.device)
        self.times.append(time.perf_counter() - self.t0)


def train_row(target: Target, config_dir: str, layout: str, checkpointing: bool, opts, device) -> dict:
    """One training row: step time, tokens/s, peak memory vs the estimate, MFU."""
    on_gpu = device.type == "cuda"
    module = SPDModule(
        target=config_dir,
        target_dtype=opts.dtype,
        n=opts.n,
        num_layers=opts.ls,
        layout=layout,
        activation_checkpointing=checkpointing,
        init_head=True,
    )
    module.use_target(target)
    data = ValidatedChats(target.vocab_size, opts.length, opts.batch, opts.steps, opts.draft_vocab)
    timer = StepTimer(device)
    trainer = L.Trainer(
        accelerator="gpu" if on_gpu else "cpu",
        devices=1,
        precision="bf16-mixed" if on_gpu else "32",
        max_steps=opts.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        check_val_every_n_epoch=2,  # the run is one epoch: the sanity check is its only validation
        callbacks=[timer],
    )
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit(module, data)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None  # CPU: tests/test_estimate.py
    step_s = statistics.median(timer.times[1:] or timer.times)  # the first step compiles
    shape = Shape(
        opts.batch,
        opts.length,
        opts.draft_vocab,
        "bf16-mixed" if on_gpu else "32",
        "ddp",
        opts.dtype,
        checkpointing,
        "flex" if on_gpu else "dense",
        dict(module.hparams),
    )
    predicted = estimate(shape, target.config)
    flops = predicted["flops_per_token"] * opts.batch * opts.length / step_s
    peak_flops = bf16_peak_flops(torch.cuda.get_device_name(device)) if on_gpu else None
    del module, trainer
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return {
        "layout": layout,
        "checkpointing": checkpointing,
        "step_s": step_s,
        "first_step_s": timer.times[0],
        "validated_first": timer.validated_first,
        "tokens_per_s": opts.batch * opts.length / step_s,
        "peak_gib": peak,
        "estimate_gib": predicted["total"] / 2**30,
        "model_tflops_per_s": flops / 1e12,
        "mfu": None if peak_flops is None else flops / peak_flops,
    }


def median_time(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times)


@torch.no_grad()
def stage_latencies(target: Target, n: int, prompt: torch.Tensor, repeats: int, device) -> list[float]:
    """Per stage: seconds for one token after a prefill of `prompt` (the decoder's steady state)."""
    geometry = Geometry.build(target.num_layers, n)
    out = []
    x = prompt
    for s in range(1, n + 1):
        stage = Stage.from_target(target, geometry, s)
        hidden = stage.prefill(0, x, 0)[0]
        token = prompt[:, -1:] if s == 1 else hidden[:, -1:]
        out.append(median_time(one_token_steps(stage, token, prompt.shape[1]), device, repeats))
        x = hidden
    return out


def one_token_steps(stage: Stage, token: torch.Tensor, start: int):
    """A callable that runs `stage` on one more token at the next position each time it is called."""
    position = [start]

    def step():
        stage.step(token, {0: position[0]})
        position[0] += 1

    return step


def draft_latency(target: Target, num_layers: int, opts, prompt: torch.Tensor, device) -> float:
    n = opts.n
    geometry = Geometry.build(target.num_layers, n)
    pdm = target_shaped_pdm(
        target.config,
        geometry,
        num_layers,
        draft_vocab=opts.draft_vocab,
        device=device,
        dtype=target.lm_head.weight.dtype,
    )
    drafter = PDMDrafter(pdm, geometry, target.embed_tokens, target.lm_head.weight.dtype, 1)
    P = prompt.shape[1]
    drafter.start(0, prompt[0], P + n + 2)
    view = geometry.view(P - 1, n)[-n:]  # the in-flight tokens, as the runner drafts (the prompt: committed once)
    return median_time(lambda: drafter.draft({0: view}), device, opts.repeats)


@torch.no_grad()
def decode_check(target: Target, opts, device) -> dict:
    geometry = Geometry.build(target.num_layers, opts.n)
    torch.manual_seed(1)
    pdm = target_shaped_pdm(
        target.config, geometry, opts.ls, draft_vocab=opts.draft_vocab, device=device, dtype=target.lm_head.weight.dtype
    )
    prompt = torch.randint(0, target.vocab_size, (opts.prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    spd = simulate_decode(target, pdm, geometry, prompt, opts.new_tokens)
    ar = ar_decode(target, prompt, opts.new_tokens)
    return {
        "identical": spd.tokens == ar.tokens,
        "new_tokens": spd.N,
        "spd_cycles": spd.K,
        "spd_decode_s": spd.decode_s,
        "ar_decode_s": ar.decode_s,
    }


def check_arch(arch: str, opts, device, budget: Budget) -> None:
    """Every row of one target, each appended to rows.jsonl as it is measured; a failed training row is a row
    with its error, and the section goes on."""
    dtype = torch.bfloat16 if opts.dtype == "bfloat16" else torch.float32
    t0 = time.perf_counter()
    target, config_dir = build_target(arch, opts, device, dtype)
    kernels = gated_deltanet()
    emit(
        opts.out,
        "arch",
        {
            "arch": ARCHS[arch],
            "layers": target.num_layers,
            "gated_deltanet": kernels,
            "params_b": sum(p.numel() for p in target.parameters()) / 1e9,
            "build_s": time.perf_counter() - t0,
        },
    )
    for layout in ("depth", "type"):
        for checkpointing in (False, True):
            if budget.allows(f"{arch} train {layout} ckpt={checkpointing}", opts.section_s):
                try:
                    row = train_row(target, config_dir, layout, checkpointing, opts, device)
                except Exception as e:  # noqa: BLE001 - the row says what failed; the next rows still run
                    row = {"layout": layout, "checkpointing": checkpointing, "error": f"{type(e).__name__}: {e}"[:300]}
                row.update(arch=ARCHS[arch], gated_deltanet=kernels)
                emit(opts.out, "train", row)
    prompt = torch.randint(0, target.vocab_size, (1, opts.prompt), device=device)
    for n in (4, 8):
        if budget.allows(f"{arch} stage latency n={n}", opts.section_s / 2):
            ms = [1e3 * s for s in stage_latencies(target, n, prompt, opts.repeats, device)]
            emit(opts.out, "stage_latency", {"arch": ARCHS[arch], "n": n, "ms": ms})
    for ls in (1, 2, 3, 4):
        if budget.allows(f"{arch} draft latency L_s={ls}", opts.section_s / 4):
            ms = 1e3 * draft_latency(target, ls, opts, prompt, device)
            emit(opts.out, "draft_latency", {"arch": ARCHS[arch], "ls": ls, "ms": ms})
    if budget.allows(f"{arch} decode check", opts.section_s):
        emit(opts.out, "decode", {"arch": ARCHS[arch], **decode_check(target, opts, device)})
    del target
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def section_budget(limit_s: float) -> Budget:
    """A child's budget: it ends 5 s before the parent cuts the child, at the instant the parent set when it
    spawned it (the child's imports take seconds of the limit: counted from here, a row planned to fit would be
    killed, not skipped); `limit_s` from now when run by hand."""
    return Budget(float(os.environ.get(DEADLINE, time.time() + limit_s)) - 5)


def train_section(opts, device) -> None:
    budget = section_budget(opts.train_s)
    if opts.layers:
        print(f"note: targets cut to {opts.layers} layers (the real models have 32)", flush=True)
    for arch in opts.archs:
        check_arch(arch, opts, device, budget)
    for what in budget.skipped:
        emit(opts.out, "skipped", {"section": "train", "what": what})


def compile_section(opts, device) -> None:
    """The compile checks: compiled flex forward and backward, then the block mask per step vs per shape."""
    flex_compile_check(opts, device)
    for layout in ("depth", "type"):
        row = block_mask_row(layout, opts.n, opts.length, opts.batch, str(device), 1 if opts.tiny else 5)
        emit(opts.out, "block_mask", row)


DECODE_KINDS = ("decode_stage", "decode_draft", "decode_simulator", "decode_cycle")


def run_section(opts, name: str, command: list[str], limit: float) -> dict:
    """One section as a child process cut at `limit` seconds, told that instant ($GPU_CHECK_DEADLINE); what it
    measured is already in rows.jsonl."""
    t0, result = time.perf_counter(), {"section": name, "command": command, "limit_s": limit}
    env = {**os.environ, DEADLINE: repr(time.time() + limit)}
    try:
        done = subprocess.run(command, timeout=limit, env=env)  # its log: our stdout and stderr
        result["error"] = None if done.returncode == 0 else f"exit code {done.returncode}"
    except subprocess.TimeoutExpired:
        result["error"] = f"cut short at its {limit:.0f} s limit"
    result["seconds"] = time.perf_counter() - t0
    emit(opts.out, "section", result)
    return result


def decode_command(opts) -> list[str]:
    """scripts/bench_decode_gpu.py appending its rows to this run's rows.jsonl (the GPU check's plan: the 4B
    shape, n 4 and 8, L_s 1 and 3)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_decode_gpu.py")
    if opts.tiny:
        plan = [
            "--tiny",
            "--device",
            "cpu",
            "--no-compile",
            "--n",
            "2",
            "4",
            "--alpha",
            "2:2:0.5",
            "--alpha",
            "4:4:0.66",
        ]
    else:  # compiling every (n, L_s) of both shapes would not fit the limit
        plan = ["--device", opts.device, "--models", "4b", "--n", "4", "8", "--draft-layers", "1", "3", "--iters", "30"]
    files = ["--rows", os.path.join(opts.out, "rows.jsonl"), "--json", os.path.join(opts.out, "decode_gpu.json")]
    return [sys.executable, script, *plan, *files, "--md", os.path.join(opts.out, "decode_gpu.md")]


def read_rows(out: str) -> list[dict]:
    path = os.path.join(out, "rows.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:  # a line cut by a killed child is not a row
        return [json.loads(line) for line in f.read().splitlines() if line.endswith("}")]


def report_from_rows(rows: list[dict], opts, device_name: str, t0: float) -> dict:
    """gpu_check.json's report, from the rows every section appended."""
    of = lambda kind: [r for r in rows if r["kind"] == kind]  # noqa: E731
    archs = []
    for meta in of("arch"):
        name = meta["arch"]
        mine = lambda kind: [r for r in of(kind) if r["arch"] == name]  # noqa: E731, B023
        decode = mine("decode")
        archs.append(
            {
                **{k: v for k, v in meta.items() if k != "kind"},
                "train": mine("train"),
                "stage_latency_ms": {r["n"]: r["ms"] for r in mine("stage_latency")},
                "draft_latency_ms": {r["ls"]: r["ms"] for r in mine("draft_latency")},
                **({"decode": {k: v for k, v in decode[0].items() if k not in ("kind", "arch")}} if decode else {}),
            }
        )
    sections = {r["section"]: {k: v for k, v in r.items() if k != "kind"} for r in of("section")}
    decode_rows = [r for r in rows if r["kind"] in DECODE_KINDS]
    skipped = [r["what"] for r in of("skipped")]
    skipped += [f"{s['section']} ({s['error']})" for s in sections.values() if s["error"] and "cut short" in s["error"]]
    return {
        "device": device_name,
        "gated_deltanet": gated_deltanet(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "torch": torch.__version__,
        "options": dict(vars(opts)),
        "sections": list(sections.values()),
        "decode_gpu": None if "decode" not in sections else {**sections["decode"], "rows": decode_rows},
        "archs": archs,
        "flex_compile": of("flex_compile"),
        "block_mask": of("block_mask"),
        "skipped": skipped,
        "total_s": time.perf_counter() - t0,
    }


def decode_markdown(decode: dict) -> list[str]:
    """The decoder's tables, from the rows it appended to rows.jsonl."""
    rows, command = decode["rows"], decode["command"]
    plan = command[2 : command.index("--rows")]
    lines = [
        "",
        f"Decoder at GPU speed (`scripts/bench_decode_gpu.py {' '.join(plan)}`, {decode['seconds']:.0f} s"
        + ("" if decode["error"] is None else f"; did not finish: {decode['error'].splitlines()[-1]}")
        + "): per planner row, the measured stage and draft steps and the simulator's overhead.",
        "",
        "| target | captured | n | L_s | alpha | ms/cycle | stage ms | draft ms | overhead ms | predicted speedup "
        "| CUDA graphs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["kind"] == "decode_cycle":
            graphs = (
                "yes"
                if r["cuda_graphs"]
                else "no (" + "; ".join(f"{k}: {v}" for k, v in r["cuda_graphs_skip"].items()) + ")"
            )
            lines.append(
                f"| {r['model']} | {'yes' if r['captured'] else 'no'} | {r['n']} | {r['L_s']} | {r['alpha']} | "
                f"{r['cycle_ms']:.3f} | {r['stage_ms']:.3f} | {r['draft_ms']:.3f} | {r['overhead_ms']:.3f} | "
                f"{r['speedup']:.2f} | {graphs} |"
            )
    lines += [
        "",
        "| target | step | n | L_s | captured | ms | CUDA graphs | skip reason |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["kind"] in ("decode_stage", "decode_draft"):
            step = f"stage {r['stage']} ({r['layers']} layers)" if r["kind"] == "decode_stage" else "PDM draft"
            lines.append(
                f"| {r['model']} | {step} | {r['n']} | {r.get('L_s', '')} | {'yes' if r['captured'] else 'no'} | "
                f"{r['ms']:.3f} | {'yes' if r['cuda_graphs'] else 'no'} | {r['cuda_graphs_skip'] or ''} |"
            )
    return lines


def markdown(report: dict) -> str:
    """The tables for docs/BENCHMARKS.md, in the order the sections ran."""
    o = report["options"]
    lines = [
        f"GPU check: `bash scripts/gpu_check.sh` on {report['device']}, {report['date']}; random-init targets "
        f"({o['dtype']}), T={o['length']}, B={o['batch']}, n={o['n']}, L_s={o['ls']}, "
        f"V_d={o['draft_vocab']}. Gated DeltaNet: {report['gated_deltanet']}.",
    ]
    if report.get("decode_gpu") is not None:
        lines += decode_markdown(report["decode_gpu"])
    lines += [
        "",
        "| target | layers | layout | checkpointing | tokens/s | step s | first step s | peak GiB | estimate GiB "
        "| MFU | Gated DeltaNet |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["archs"]:
        for t in r["train"]:
            head = f"| {r['arch']} | {r['layers']} | {t['layout']} | {'yes' if t['checkpointing'] else 'no'} |"
            if "error" in t:
                lines.append(f"{head} FAILED: {t['error']} | | | | | | |")
                continue
            lines.append(
                f"{head} {t['tokens_per_s']:.0f} | {t['step_s']:.3f} | {t['first_step_s']:.1f} | "
                f"{'n/a' if t['peak_gib'] is None else format(t['peak_gib'], '.1f')} | "
                f"{t['estimate_gib']:.1f} | {'n/a' if t['mfu'] is None else format(t['mfu'], '.1%')} | "
                f"{t['gated_deltanet']} |"
            )
    lines += [
        "",
        "| target | n | per-stage forward ms (one token) | PDM draft ms, L_s = 1, 2, 3, 4 | greedy SPD == AR |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in report["archs"]:
        drafts = ", ".join(f"{r['draft_latency_ms'][k]:.2f}" for k in sorted(r["draft_latency_ms"]))
        decode = r.get("decode")
        same = (
            "skipped" if decode is None else f"{'yes' if decode['identical'] else 'NO'} ({decode['new_tokens']} tokens)"
        )
        for n, ms in sorted(r["stage_latency_ms"].items()):
            lines.append(f"| {r['arch']} | {n} | {', '.join(f'{x:.2f}' for x in ms)} | {drafts} | {same} |")
    lines += ["", "| layout | attention path | forward + backward | seconds |", "| --- | --- | --- | --- |"]
    for c in report.get("flex_compile", []):
        result = "ok" if c["ok"] else f"FAILED: {c['error']}"
        lines.append(f"| {c['layout']} | {c['backend']}, head_dim {c['head_dim']} | {result} | {c['seconds']:.1f} |")
    if report.get("block_mask"):
        lines += ["", "FlexAttention block mask per step (`scripts/bench_block_mask.py`):", ""]
        lines += [block_mask_markdown([{k: v for k, v in r.items() if k != "kind"} for r in report["block_mask"]])]
    if report["skipped"]:
        lines += ["", f"Skipped to stay within the time limits: {', '.join(report['skipped'])}."]
    return "\n".join(lines) + "\n"


def write(report: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(markdown(report))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check", help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny widths and lengths (the CPU smoke test)")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--layers", type=int, default=0, help="fewer target layers than the real model (0: all)")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--ls", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=256, help="head_dim of the flex compile check (the shipped PDM's)")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3, help="training steps per row (the first one compiles)")
    p.add_argument("--prompt", type=int, default=256, help="prompt length for the latency and decode checks")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--decode-s", type=float, default=150, help="time limit of the decoder section (0: skip it)")
    p.add_argument("--train-s", type=float, default=190, help="time limit of the training section (0: skip it)")
    p.add_argument("--compile-s", type=float, default=60, help="time limit of the compile checks (0: skip them)")
    p.add_argument("--section-s", type=float, default=40, help="time one training row is assumed to need")
    p.add_argument("--section", choices=["train", "compile"], help=argparse.SUPPRESS)  # a child's own section
    opts = p.parse_args(argv)
    if opts.tiny:
        opts.length, opts.draft_vocab, opts.steps, opts.prompt, opts.new_tokens, opts.repeats = 32, 64, 2, 16, 4, 2
        opts.layers, opts.n, opts.head_dim = opts.layers or 8, 4, 16
        # a rehearsal on a shared CPU: the limits guard the GPU's 8 minutes, not this
        opts.decode_s, opts.train_s, opts.compile_s = (
            600 if s else 0 for s in (opts.decode_s, opts.train_s, opts.compile_s)
        )
    opts.dtype = "bfloat16" if opts.device.startswith("cuda") else "float32"
    return opts


def section_main(opts, device) -> int:
    """In a child: run one section (`--section`), every row appended to rows.jsonl as it is measured."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one line per section is enough
    if opts.section == "train":
        train_section(opts, device)
    else:
        compile_section(opts, device)
    return 0


def main(argv=None) -> int:
    opts = parse(argv)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; run with --device cpu --tiny for the CPU rehearsal", file=sys.stderr)
        return 2
    if opts.section:
        return section_main(opts, device)
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    os.makedirs(opts.out, exist_ok=True)
    open(os.path.join(opts.out, "rows.jsonl"), "w").close()  # this run's rows only
    self_command = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
    sections = [  # the decoder first, then training, then the compile checks
        ("decode", decode_command(opts), opts.decode_s),
        ("train", [*self_command, "--section", "train"], opts.train_s),
        ("compile", [*self_command, "--section", "compile"], opts.compile_s),
    ]
    for name_, command, limit in sections:
        if limit > 0:
            run_section(opts, name_, command, limit)
        else:
            emit(opts.out, "skipped", {"section": name_, "what": f"{name_} section (limit 0)"})
        report = report_from_rows(read_rows(opts.out), opts, name, t0)
        write(report, opts.out)  # after every section: a run cut short still leaves its figures
    print(markdown(report), flush=True)
    same = all(r.get("decode", {}).get("identical", True) for r in report["archs"])
    return 0 if same and all(c["ok"] for c in report["flex_compile"]) else 1


if __name__ == "__main__":
    sys.exit(main())
