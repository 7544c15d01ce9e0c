"""The in-process decoders behind `decode --simulate`, `eval` and `serve`: one mode dispatch for all three.

A `Backend` turns one prompt into a `DecodeResult`, calling `on_tokens` with the tokens each cycle verified.
`make_backend(setup, ...)` picks it from the setup's mode, with the target's weights loaded once (or shared
with the caller's `target`):

    ar                     `ARBackend`: plain autoregressive decoding through the same stages (the reference;
                           `compile`: their one-token steps compiled, as the pipeline's)
    eagle3                 `ChainBackend`: EAGLE-3 chain decoding, `setup.k` drafts per verify forward (eager only)
    spd, post_step, ppsd   `SimulatorBackend`: the pipeline's runner with every rank in this process

The n + 1 processes are the other backend: `inference.processes.launch` for a batch of prompts, and the
server's persistent ranks (`inference.serving.ranks.RankBackend`). `serve --simulate` feeds the pipeline's
runner its requests at step boundaries, as the ranks do (`inference.serving.batch_backend`); it takes only the
`ar` and `eagle3` backends from here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from inference.chain.decoder import ChainDecoder
from inference.cycle.ar import ar_decode_stages, ar_stages
from inference.cycle.result import DecodeResult
from inference.cycle.simulator import Simulator
from inference.sampling import Sampling
from inference.setup import Setup
from spd_lightning.eagle3.export import KIND as EAGLE3
from spd_lightning.export import load_drafter
from spd_lightning.target import Target

log = logging.getLogger("inference")

OnTokens = Callable[[list[int]], None]


class BackendFailure(Exception):
    """The decoder failed for a reason that is not the request's (e.g. a rank died)."""


class Cancelled(Exception):
    """The client is gone: the decode stops at this cycle (raised by `on_tokens`, or by a backend that was
    told to `cancel`)."""


class Backend(Protocol):
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: Sampling,
        seed: int,
        on_tokens: OnTokens | None = None,
    ) -> DecodeResult: ...

    def close(self) -> None:
        """Release what the backend runs (the in-process ones below run nothing but this process: a no-op)."""


def is_alive(backend: Backend) -> bool:
    """False once a backend can serve no more (its ranks died); in-process backends always can."""
    return getattr(backend, "alive", lambda: True)()


def is_ready(backend: Backend) -> bool:
    """True once the backend has loaded (its ranks have met); in-process backends load when built."""
    return getattr(backend, "ready", lambda: True)()


def make_backend(
    setup: Setup,
    device: str = "cpu",
    target: Target | None = None,
    compile: bool = False,
    profile: bool = False,
    max_batch: int = 1,
) -> Backend:
    """The in-process decoder of `setup.mode` (see the module docstring); `target`: weights already loaded."""
    target = target or Target.load(setup.target_path, setup.dtype, device, setup.trust_remote_code)
    if setup.mode == EAGLE3:
        if compile:
            log.warning("--compile: chain decoding (--mode eagle3) has no compiled path; it runs eagerly")
        return ChainBackend(setup, target)
    if setup.mode == "ar":
        return ARBackend(setup, target, compile)
    return SimulatorBackend(setup, target, device, compile, profile, max_batch)


class ARBackend(Backend):
    def __init__(self, setup: Setup, target: Target, compile: bool = False):
        self.eos = setup.eos
        self.stages = ar_stages(target, setup.geometry, compile=compile)

    def generate(self, prompt_ids, max_new_tokens, sampling, seed, on_tokens=None) -> DecodeResult:
        return ar_decode_stages(self.stages, prompt_ids, max_new_tokens, sampling, self.eos, seed, on_tokens)


class ChainBackend(Backend):
    """A decode starts from a reset cache: nothing to rebuild after a failure."""

    def __init__(self, setup: Setup, target: Target):
        self.eos = setup.eos
        self.chain = ChainDecoder.on_target(target, setup.ckpt, setup.k)

    def generate(self, prompt_ids, max_new_tokens, sampling, seed, on_tokens=None) -> DecodeResult:
        decoder = self.chain.variant(self.chain.k, sampling)
        return decoder.decode(prompt_ids, max_new_tokens, self.eos, seed, on_tokens).to_decode_result()


class SimulatorBackend(Backend):
    """One simulator: each decode brings its own sampling. A decode that fails leaves its messages half-delivered,
    so the next one gets a fresh simulator (over the same weights)."""

    def __init__(self, setup: Setup, target: Target, device: str, compile: bool, profile: bool, max_batch: int):
        pdm = load_drafter(setup.ckpt, device, target.lm_head.weight)[0].to(target.model.dtype)
        self.eos = setup.eos
        self._build = lambda: Simulator(
            target, pdm, setup.geometry, profile=profile, compile=compile, max_batch=max_batch
        )
        self.simulator = self._build()

    def generate(self, prompt_ids, max_new_tokens, sampling, seed, on_tokens=None) -> DecodeResult:
        try:
            return self.simulator.decode(prompt_ids, max_new_tokens, self.eos, seed, on_tokens, sampling=sampling)
        except BaseException:
            self.simulator = self._build()
            raise
