"""Batched decoding in the one-process simulator (issue 26): total and per-request tokens/s at B = 1, 2, 4, 8.

The same requests (greedy, mixed prompt lengths) are decoded by `BatchSimulator` at each batch size; each run
first checks every sequence against the B = 1 run (tokens and K). The stages run in sequence in one process,
so this measures what batching saves per cycle (one forward over B slots instead of B forwards), not the
pipeline's wall clock on n devices.

    python scripts/bench_batch.py --requests 16 --max-new-tokens 48 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3_5", choices=["qwen3", "qwen3_5"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from kit import make_tiny_model, random_pdm  # the test fixtures' random models

    from inference.cycle.batch import BatchSimulator
    from inference.cycle.slots import Request
    from spd_lightning.geometry import Geometry
    from spd_lightning.target import Target

    target = Target(make_tiny_model(args.arch, num_layers=args.layers, hidden_size=args.hidden), "bench")
    geometry = Geometry.build(target.num_layers, args.n)
    pdm = random_pdm(target, geometry)
    g = torch.Generator().manual_seed(0)
    requests = [
        Request(
            torch.randint(1, 90, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist(),
            args.max_new_tokens,
        )
        for _ in range(args.requests)
    ]
    rows, reference = [], None
    for B in args.batch:
        simulator = BatchSimulator(target, pdm, geometry, B)
        t0 = time.perf_counter()
        results = simulator.run(requests)
        wall = time.perf_counter() - t0
        outputs = [(r.tokens, r.K) for r in results]
        reference = reference or outputs
        if outputs != reference:
            raise SystemExit(f"B={B}: a sequence differs from its B={args.batch[0]} decode")
        tokens = sum(r.N for r in results)
        per_request = statistics.median(r.N / (r.prefill_s + r.decode_s) for r in results)
        rows.append(
            {
                "B": B,
                "tokens": tokens,
                "wall_s": round(wall, 3),
                "tok_s": round(tokens / wall, 1),
                "per_request_tok_s": round(per_request, 1),
                "cycles": simulator.cycles,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print("| B | tokens | wall | tok/s total | tok/s per request (median) | cycles |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['B']} | {r['tokens']} | {r['wall_s']} s | {r['tok_s']} | {r['per_request_tok_s']} | {r['cycles']} |"
        )


if __name__ == "__main__":
    main()
