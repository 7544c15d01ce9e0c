"""A prompt's prefill through the ranks (`PipelineRunner.join`): every stage in order fills its own cache and
sends its output on, then each stage with anchor states sends them to the PDM, which stores them. The caller says
what a stage runs (one slot of a stage) and where the PDM keeps the states (`run_stage`, `store_anchors`); the
first token is the caller's: it samples it from the returned logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from inference.cycle.messages import Mailboxes

# stage s, its input (ids [1, P] on stage 1, states [1, P, H] after) -> (output [1, P, H], anchors [P, A, H], logits)
RunStage = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


class Runner(Protocol):
    """What of a runner the prefill uses."""

    n: int
    box: Mailboxes
    stages: Mapping[int, object]
    anchor_counts: Mapping[int, int]

    def _send(self, src: int, dst: int, kind: str, tensor: torch.Tensor | None = None) -> None: ...
    def _recv(self, src: int, dst: int, kind: str, buffer: torch.Tensor | None = None) -> torch.Tensor | None: ...


def prefill_stages(
    runner: Runner,
    prompt: torch.Tensor,
    hidden_size: int,
    run_stage: RunStage,
    store_anchors: Callable[[int, torch.Tensor], None],
) -> torch.Tensor | None:
    """`prompt` `[1, P]` through every stage in order, then each stage's anchors `[P, A_s, H]` to the PDM
    (`store_anchors(s, states)` where the PDM is hosted). Returns the last stage's logits of position P-1 where
    that stage is hosted, else None."""
    n, P, H, box = runner.n, prompt.shape[1], hidden_size, runner.box
    hidden, anchors, logits = None, {}, None
    for s in range(1, n + 1):
        if s in runner.stages:
            box.outbox[s - 1, "act_prefill"], anchors[s], out_logits = run_stage(s, prompt if s == 1 else hidden)
            logits = out_logits if s == n else logits
        if s < n:
            runner._send(s - 1, s, "act_prefill")
            hidden = runner._recv(s - 1, s, "act_prefill", box.prefill_buffer(s, "act", 1, 1, P, H))
    for s, count in runner.anchor_counts.items():
        if count:
            runner._send(s - 1, n, "anchors_prefill", anchors.get(s))
            states = runner._recv(s - 1, n, "anchors_prefill", box.prefill_buffer(n, f"anchors{s}", 0, P, count, H))
            if states is not None:
                store_anchors(s, states)
    return logits
