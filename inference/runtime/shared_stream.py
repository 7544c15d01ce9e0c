"""The shared PDM's draft on its own CUDA stream, so it overlaps stage 1's forward on their one GPU.

With `--pdm-placement shared` process 0 launches stage 1's token first (the runner's `_compute`, on the main
stream), then receives the other stages' anchor states and drafts (`_draft`), both on a second stream, so the GPU
runs them beside stage 1's forward, and the host never waits in between (docs/DESIGN.md, "The critical path":
"Shared placement"). The dependencies are CUDA events, never a device-wide synchronization:

- the draft reads what the drafter's inputs wrote on the main stream (`start`, `set_token`, and
  `store_anchors` of stage 1's own anchors, taken from within the process): each records `inputs_ready`
  there, and the side stream waits on the latest before it receives or drafts. Pre-step these all come
  before stage 1's forward is launched, so neither the receives nor the draft wait for the forward;
  post-step this cycle's anchors come out of the forward, and the draft waits for it, as it must;
- `receiving()` runs the receives from the other processes and their `store_anchors` on the side stream
  (an NCCL receive waits for, and is waited on by, the stream that is current when it is posted); the main
  stream then waits on an event recorded after them, so its next work (the next step) sees the stored
  states even when no draft follows (a wasted step);
- what the draft returns (the token, `q`) and writes (the new token's embedding, the PDM's KV cache) is
  next used on the main stream (stage 1's next input, the message to the verifier, the next inputs):
  the draft runs inside `receiving()`, so the main stream waits on the event recorded after it, and the returned
  tensors are marked as used by the main stream, so the allocator does not hand out their memory early.

On the CPU there are no streams: `draft_stream` is None, `use_stream(None)` is a no-op context and no
event is recorded, so the CPU runs exactly this code, in the same order, with the draft in line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from inference.runtime.drafter import DraftBatch, Drafter
from inference.sampling import Sampling


def draft_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A second stream on `device` for the draft; None where there are no streams (the CPU)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def use_stream(stream: torch.cuda.Stream | None):
    """The context that launches work on `stream`; a no-op context for None."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)


class SideStreamDrafter:
    """`drafter` with its draft launched on `stream` (None: in line); see the module docstring."""

    def __init__(
        self,
        drafter: Drafter,
        stream: torch.cuda.Stream | None,
        main_stream: Callable[[], torch.cuda.Stream] | None = None,
    ):
        self.drafter, self.stream = drafter, stream
        self.main_stream = main_stream or (lambda: torch.cuda.current_stream(stream.device))
        self.inputs_ready = None  # the event of the latest input written on the main stream
        self._on_side = False  # inside `receiving()`: inputs are written on the side stream

    def start(self, slot: int, prompt_ids: torch.Tensor, capacity: int, sampling: Sampling, seed: int) -> None:
        self.drafter.start(slot, prompt_ids, capacity, sampling, seed)
        self._inputs_written()

    def set_token(self, slot: int, position: int, token: int) -> None:
        self.drafter.set_token(slot, position, token)
        self._inputs_written()

    def store_anchors(self, slot: int, stage: int, start: int, states: torch.Tensor) -> None:
        self.drafter.store_anchors(slot, stage, start, states)
        self._inputs_written()

    def store_step_anchors(self, stage: int, positions, states: torch.Tensor) -> None:
        self.drafter.store_step_anchors(stage, positions, states)
        self._inputs_written()

    @contextmanager
    def receiving(self) -> Iterator[None]:
        """Receives (and `store_anchors`) of the draft's inputs from other processes, on the side stream, after
        the main-stream inputs so far and never after work launched on the main stream since."""
        if self.stream is None:
            yield
            return
        if self.inputs_ready is not None:
            self.stream.wait_event(self.inputs_ready)
        self._on_side = True
        try:
            with use_stream(self.stream):
                yield
        finally:
            self._on_side = False
            self.main_stream().wait_event(self.stream.record_event())

    def draft(self, views, rows: int | None = None) -> DraftBatch:
        with self.receiving():  # as the receives: on the side stream after the inputs, and waited for by the main
            drafts = self.drafter.draft(views, rows)
        if self.stream is not None:
            main = self.main_stream()
            for tensor in drafts:
                if tensor is not None:
                    tensor.record_stream(main)
        return drafts

    def _inputs_written(self) -> None:
        if self.stream is not None and not self._on_side:
            self.inputs_ready = self.main_stream().record_event()
