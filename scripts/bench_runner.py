"""The batch-1 cycle of the in-process runner, for comparing two versions of the decoder on the same machine.

    .venv/bin/python scripts/bench_runner.py --repo /tmp/old_main --label old
    .venv/bin/python scripts/bench_runner.py --repo . --label new

`--repo` is the checkout whose `inference/` (and `tests/kit`) is imported, so one script times any version whose
`Simulator(target, pdm, geometry).decode(prompt, max_new_tokens)` it can call. It decodes the same prompts
through the tiny hybrid Qwen3.5 target of the tests (n = 3, a random PDM: rejections and refills, every fill
level) after one warm-up pass, `--repeat` times, and prints one JSON line: the median over the repeats of the
decode seconds per cycle (prefill excluded), and of the process's CPU seconds per cycle over whole decodes
(prefill included: on a shared machine the CPU clock ignores other jobs' time slices), and the minimum of the
latter (`cpu_s_per_cycle_min`: the repeat least slowed by other jobs sharing the cores and caches). The tiny target
makes the runner's host work most of a cycle, so this is where a slower runner shows most. Interleave the versions'
runs on a shared machine and compare medians and minima.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="the checkout whose decoder is timed")
    parser.add_argument("--label", required=True)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    repo = os.path.abspath(args.repo)
    sys.path[:0] = [repo, os.path.join(repo, "tests")]
    import torch
    from kit import make_tiny_model, random_pdm

    from inference.cycle.simulator import Simulator
    from spd_lightning.geometry import Geometry
    from spd_lightning.target import Target

    torch.set_num_threads(1)
    torch.manual_seed(0)
    target = Target(make_tiny_model("qwen3_5"), "tiny-qwen3_5")
    geometry = Geometry.build(target.num_layers, 3)
    simulator = Simulator(target, random_pdm(target, geometry, num_layers=1), geometry)
    prompts = [[3, 14, 15, 92, 65], [7, 7, 8], [11, 12, 13, 14, 15, 16]]
    per_cycle, cpu_per_cycle = [], []
    for attempt in range(args.repeat + 1):
        cpu = time.process_time()
        results = [simulator.decode(prompt, args.max_new_tokens) for prompt in prompts]
        cpu = time.process_time() - cpu
        if attempt:  # the first pass warms up
            K = sum(r.K for r in results)
            per_cycle.append(sum(r.decode_s for r in results) / K)
            cpu_per_cycle.append(cpu / K)
    row = {
        "label": args.label,
        "s_per_cycle": statistics.median(per_cycle),
        "cpu_s_per_cycle": statistics.median(cpu_per_cycle),
        "cpu_s_per_cycle_min": min(cpu_per_cycle),
        "K": K,
    }
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
