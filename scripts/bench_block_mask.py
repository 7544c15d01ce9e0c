"""The FlexAttention block mask of a training step: `create_block_mask` per step against the shape's cached block
structure (spd_lightning/training/block_sparsity.py), in time and in the blocks each gives the kernel.

    python scripts/bench_block_mask.py --ns 4 8 --seq-lens 512 1024 --batch-size 2 --markdown

Per (layout, n, T), on random fills and ragged lengths (one sample full, the others shorter): the seconds of
one eager `create_block_mask` over all `S = copies * T` rows (what the flex path ran each step), of building
the shape's structure (once per shape), and of a step's block mask from it (every later step); and the
blocks each mask touches, full and partial. The CPU times are not the GPU's (compiled `create_block_mask` is
much faster there; `--device cuda --repeats 5` measures that, and `scripts/gpu_check.py` runs it); the block
counts are the same on any device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference.evaluation.tables import fmt, markdown_table  # noqa: E402
from spd_lightning.geometry import Geometry  # noqa: E402
from spd_lightning.training import block_sparsity  # noqa: E402
from spd_lightning.training.layouts import build_layout  # noqa: E402


def blocks(mask) -> tuple[int, int]:
    """(partial, full) blocks summed over the batch."""
    full = 0 if mask.full_kv_num_blocks is None else int(mask.full_kv_num_blocks.sum())
    return int(mask.kv_num_blocks.sum()), full


def timed(fn, device: torch.device, repeats: int = 1):
    """`fn()` and the median seconds of `repeats` calls (after one untimed call when `repeats > 1`: compiles)."""
    out, times = fn() if repeats > 1 else None, []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return out, sorted(times)[len(times) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(layout_name: str, n: int, T: int, batch: int, device: str = "cpu", repeats: int = 1) -> dict:
    """One row. On CUDA `create_block_mask` is the compiled one the flex path runs (`attention.compiled_flex`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from spd_lightning.training.attention import compiled_flex

    device = torch.device(device)
    make_mask = compiled_flex()[0] if device.type == "cuda" else create_block_mask
    layout = build_layout(layout_name, Geometry.build(max(8, n), n))
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([T] + [int(T * (0.5 + 0.4 * i / max(batch - 1, 1))) for i in range(batch - 1)])
    rep = layout.replicate(lengths.to(device), T, layout.draw_fill(batch, T, gen).to(device))
    S = rep.seq_len
    exact, t_exact = timed(lambda: make_mask(rep.mask_mod, batch, None, S, S, device=device), device, repeats)
    block_sparsity._SKELETONS.clear()
    skel, t_build = timed(lambda: block_sparsity.skeleton(rep.shape, S, S, rep.device), device)
    step = rep.step_rows()
    cached, t_step = timed(lambda: block_sparsity.step_block_mask(skel, step, rep.mask_mod), device, repeats)
    (ep, ef), (cp, cf) = blocks(exact), blocks(cached)
    return {
        "layout": layout_name,
        "n": n,
        "T": T,
        "S": S,
        "batch": batch,
        "create_block_mask_s": t_exact,
        "structure_build_s": t_build,
        "step_from_structure_s": t_step,
        "exact_partial": ep,
        "exact_full": ef,
        "cached_partial": cp,
        "cached_full": cf,
    }


def markdown(rows: list[dict]) -> str:
    head = ["layout", "n", "T", "S", "create_block_mask (s)", "build once (s)", "per step (s)"]
    head += ["exact partial / full", "cached partial / full"]
    cells = [
        [r["layout"], r["n"], r["T"], r["S"], fmt(r["create_block_mask_s"], 4), fmt(r["structure_build_s"], 3)]
        + [fmt(r["step_from_structure_s"], 4), f"{r['exact_partial']} / {r['exact_full']}"]
        + [f"{r['cached_partial']} / {r['cached_full']}"]
        for r in rows
    ]
    return "\n".join(markdown_table(head, [[str(c) for c in row] for row in cells]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=["depth", "type"])
    p.add_argument("--ns", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cuda: the compiled create_block_mask, as the flex path runs it")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per mask (median), after a warm-up when > 1")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for layout_name in args.layouts:
        for n in args.ns:
            for T in args.seq_lens:
                rows.append(measure(layout_name, n, T, args.batch_size, args.device, args.repeats))
                print(rows[-1], file=sys.stderr)
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
