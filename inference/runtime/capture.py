"""Captured decode steps (`--compile`): `torch.compile` of a fixed-shape step, with an eager fallback (docs/DESIGN.md,
"The decode step at GPU speed": CUDA graphs on a GPU and inductor on the CPU, graphs keyed by shape, a compile failure
never kills a rank, CUDA graphs reported, not assumed).

One graph, no break (`fullgraph`): a break would mean a host read inside the step. Dynamic shapes off: a new shape (a
regrown cache, another fill level) is one more graph, not a slower one. Inductor silently runs a graph without CUDA
graphs when it cannot capture it, counting each skip in `counters["inductor"]["cudagraph_skips"]`: a call that
compiled and bumped that counter marks the step as not captured (`cuda_graphs` False) and logs the reason once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
from torch._dynamo.utils import counters

from spd_lightning.errors import first_line

log = logging.getLogger("inference")

# Entries per compiled code object: every stage and every fill level is one more entry of the same code,
# and the default limit of 8 would silently send the stages past it back to eager.
RECOMPILE_LIMIT = 64
# Raised while tracing or compiling, before the step ran (nothing was written yet): the step runs eagerly.
COMPILE_FAILURES = (TorchDynamoException, FailOnRecompileLimitHit)
SIDE_STREAM = "not captured: it runs on a second stream beside another captured step"


class _SkipReasons(logging.Handler):
    """Collects inductor's cudagraph skip messages (its `cudagraphs` log artifact, off by default)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


_SKIPS = _SkipReasons()


def _listen_for_cudagraph_skips() -> None:
    from torch._inductor import cudagraph_utils

    logger = cudagraph_utils.cudagraphs_log
    if _SKIPS not in logger.handlers:
        logger.addHandler(_SKIPS)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.WARNING))


class CompiledStep:
    """`step` compiled; `compiled` says whether it still runs compiled, `cuda_graphs` whether its graphs are
    captured as CUDA graphs (None until the first call, always False off a GPU or without `capture`), `skip_reason`
    why not.

    `capture=False`: inductor without CUDA graphs, for a step launched on a second stream beside another captured
    step (the shared PDM's draft, `shared_stream`). Inductor's graphs of a device share one memory pool and assume
    one graph runs at a time: two replayed concurrently write each other's activations."""

    def __init__(self, step: Callable, device: torch.device, capture: bool = True):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.eager = step
        self.name = getattr(step, "__qualname__", repr(step))
        self.captures = device.type == "cuda" and capture
        self.compiled = True
        self.cuda_graphs: bool | None = None if self.captures else False
        self.skip_reason = "" if self.captures else "not a CUDA device" if device.type != "cuda" else SIDE_STREAM
        if self.captures:
            _listen_for_cudagraph_skips()
        # explicit: TORCHINDUCTOR_CUDAGRAPHS=1 or a config set elsewhere must not capture an uncaptured step
        graphs = dict(mode="reduce-overhead") if self.captures else dict(options={"triton.cudagraphs": False})
        self._run = torch.compile(step, dynamic=False, fullgraph=True, **graphs)

    def __call__(self, *args):
        if not self.compiled:
            return self.eager(*args)
        if self.captures:  # the previous replay's outputs are consumed (cloned) by now
            torch.compiler.cudagraph_mark_step_begin()
        skips, messages = counters["inductor"]["cudagraph_skips"], len(_SKIPS.messages)
        try:
            out = self._run(*args)
        except COMPILE_FAILURES as e:
            log.warning("cannot compile %s (%s); it runs eagerly", self.name, first_line(e)[:200])
            self.compiled, self.cuda_graphs = False, False
            self.skip_reason = self.skip_reason or "not compiled"
            return self.eager(*args)
        skipped = counters["inductor"]["cudagraph_skips"] > skips
        if skipped and self.cuda_graphs is not False:  # False from the start off a GPU
            reasons = _SKIPS.messages[messages:]
            self.skip_reason = reasons[-1] if reasons else "skipped by inductor (TORCH_LOGS=cudagraphs tells why)"
            log.warning("%s runs without CUDA graphs: %s", self.name, self.skip_reason)
            self.cuda_graphs = False
        elif self.cuda_graphs is None:
            self.cuda_graphs = True
        return out
