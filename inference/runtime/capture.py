"""Captured decode steps (`--compile`): `torch.compile` of a fixed-shape step, with an eager fallback.

On a GPU the mode is "reduce-overhead" (CUDA graphs: one launch per step instead of one per kernel), on
the CPU inductor's default. One graph, no break (`fullgraph`): a break would mean a host read inside the
step. Dynamic shapes off: a new shape (a regrown cache, another fill level) is one more graph, not a
slower one. A step that cannot be compiled (a layer dynamo cannot trace, a backend that fails) runs
eagerly from then on, with one warning: the decode is the same, only slower.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("inference")

# Entries per compiled code object: every stage and every fill level is one more entry of the same code,
# and the default limit of 8 would silently send the stages past it back to eager.
RECOMPILE_LIMIT = 64


class CompiledStep:
    def __init__(self, step: Callable, device: torch.device):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.eager = step
        self.cuda_graphs = device.type == "cuda"
        self._run = torch.compile(
            step, mode="reduce-overhead" if self.cuda_graphs else None, dynamic=False, fullgraph=True
        )

    def __call__(self, *args):
        if self.cuda_graphs:  # the previous replay's outputs are consumed (cloned) by now
            torch.compiler.cudagraph_mark_step_begin()
        try:
            return self._run(*args)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as e:
            # raised while tracing or compiling, before the step ran: nothing was written yet
            log.warning(
                "cannot compile %s (%s); it runs eagerly",
                getattr(self.eager, "__qualname__", self.eager),
                str(e).splitlines()[0][:200],
            )
            self._run = self.eager
            return self._run(*args)
