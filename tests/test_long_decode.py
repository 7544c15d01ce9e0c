"""Long runs in one process (the simulator): thousands of tokens, and many prompts back to back, without
memory growth and without state carried from one prompt into the next.

A leak is memory that accumulates from cycle to cycle. Buffers sized by the current run (the drafter's
state rows, the runner's per-decode arrays) are not leaks: they are reused or replaced by the next run. So
the footprint is measured after a warm-up run and again after the SAME workload has run once more (the
drafter's type table, allocator pools and capacities all exist by then), and the growth is divided by
the cycles in between:

- live Python objects and live torch tensors (gc): at most 0.01 per cycle, so keeping ONE object or tensor
  per cycle (a list of logits, a per-cycle dict entry) fails; plus a one-time allowance of 16 objects and 2
  tensors, which does not grow with the cycles (a lazily filled cache entry of torch or Python: CI once
  saw 3 more objects over 252 cycles, where a leak of one object per cycle is 252);
- bytes held by live tensors: at most 1 B per cycle (keeping one float32 per cycle fails);
- the process's resident set (VmRSS): at most 4 KiB per cycle, for native memory no Python object owns. It is
  read after glibc's `malloc_trim`: without it, free pages of the allocator's arenas counted or not from one
  identical run to the next (about +-2 MiB; a 230-cycle run saw +2.6 MiB against a bound of 0.9 MiB).
"""

import ctypes
import ctypes.util
import gc
import random
from dataclasses import dataclass

import pytest
import torch
from kit import random_pdm

from inference.cycle.ar import ar_decode
from inference.cycle.simulator import Simulator
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry

PER_CYCLE_BOUND = {"objects": 0.01, "tensors": 0.01, "tensor_bytes": 1.0, "rss_bytes": 4096.0}
ONE_TIME = {"objects": 16, "tensors": 2, "tensor_bytes": 0, "rss_bytes": 0}


def _libc_malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _libc_malloc_trim()


def rss_bytes() -> int:
    """The resident set after glibc hands its free pages back: without the trim, a free arena's pages count or not
    depending on where the last allocation landed (CI saw +2.6 MiB over 230 cycles of an identical rerun)."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def storage_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for the wrappers that other tests' tracing (vmap, compile)
    can leave alive, which have no storage of their own."""
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    return storage.data_ptr(), storage.nbytes()


@dataclass
class Footprint:
    objects: int
    tensors: int
    tensor_bytes: int
    rss_bytes: int

    @classmethod
    def now(cls) -> "Footprint":
        """Call it once before the first measurement that counts: the first scan itself creates objects
        (isinstance over every object triggers lazy attributes and warning registries)."""
        gc.collect()
        objects = gc.get_objects()
        # Plain tensors only: tracing elsewhere in the session can leave fake tensors that have no storage.
        tensors = [o for o in objects if type(o) in (torch.Tensor, torch.nn.Parameter)]
        storages = dict(filter(None, map(storage_of, tensors)))
        return cls(len(objects), len(tensors), sum(storages.values()), rss_bytes())


def assert_no_growth(before: Footprint, after: Footprint, cycles: int, what: str) -> None:
    growth = {k: getattr(after, k) - getattr(before, k) for k in PER_CYCLE_BOUND}
    print(f"\n{what}: growth over {cycles} cycles {growth}")
    for key, per_cycle in PER_CYCLE_BOUND.items():
        bound = per_cycle * cycles + ONE_TIME[key]
        assert growth[key] <= bound, (
            f"{what}: {key} grew by {growth[key]} over {cycles} cycles (bound {per_cycle} per cycle "
            f"+ {ONE_TIME[key]} once = {bound:.4g})"
        )


def long_decode(target, tokens: int) -> None:
    """Greedy SPD for `tokens` tokens equals AR, and nothing accumulates from one cycle to the next."""
    geometry = Geometry.build(target.num_layers, 2)
    simulator = Simulator(target, random_pdm(target, geometry), geometry)
    prompt = [3, 14, 15, 92, 65, 35]
    simulator.decode(prompt, tokens)  # warm-up: the same workload
    Footprint.now()
    before = Footprint.now()
    result = simulator.decode(prompt, tokens)
    output, cycles = result.tokens, result.K
    del result
    assert_no_growth(before, Footprint.now(), cycles, f"{tokens}-token decodes")
    assert len(output) == tokens and output == ar_decode(target, prompt, tokens).tokens


def test_a_long_decode(tiny_qwen3):
    long_decode(tiny_qwen3, 200)


@pytest.mark.slow
def test_a_2000_token_decode(tiny_qwen35):
    long_decode(tiny_qwen35, 2000)


def back_to_back(target, tokens: int, count: int) -> None:
    """`count` prompts in one simulator, greedy and sampled: each result is the one a fresh simulator gives
    (caches, drafter state and random streams are reset per prompt), and nothing accumulates."""
    n = 3
    geometry = Geometry.build(target.num_layers, n)
    pdm = random_pdm(target, geometry)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, target.vocab_size) for _ in range(rng.randrange(2, 14))] for _ in range(count)]
    for sampling in (Sampling(), Sampling(1.0, top_k=20)):
        simulator = Simulator(target, pdm, geometry, sampling)

        def run() -> list:
            return [summary(simulator.decode(p, tokens, seed=i)) for i, p in enumerate(prompts)]  # noqa: B023

        warm = run()  # warm-up: the same workload
        Footprint.now()
        before = Footprint.now()
        again = run()
        assert again == warm  # the second pass over the prompts repeats the first exactly
        cycles = sum(K for _, K, _ in again)
        del again
        assert_no_growth(before, Footprint.now(), cycles, f"{count} prompts x {tokens} tokens ({sampling})")
        for i in (0, count // 2, count - 1):
            assert warm[i] == summary(Simulator(target, pdm, geometry, sampling).decode(prompts[i], tokens, seed=i))
        if sampling.greedy:
            assert all(w[0] == ar_decode(target, p, tokens).tokens for p, w in zip(prompts[:3], warm))


def summary(result) -> tuple:
    return result.tokens, result.K, result.counters


def test_prompts_back_to_back(tiny_qwen35):
    back_to_back(tiny_qwen35, 8, 6)


@pytest.mark.slow
def test_long_prompts_back_to_back(tiny_qwen35):
    back_to_back(tiny_qwen35, 64, 12)
