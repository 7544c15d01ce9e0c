"""A joining slot's prefill through the ranks (`PipelineRunner.join`; docs/DESIGN.md, "One cycle over B slots",
Prefill). The first token is the caller's: the verifier samples it from the returned logits.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from inference.cycle.result import COMPUTE
from inference.cycle.slots import SlotSequence, generator_seeds
from inference.cycle.traffic import Traffic
from inference.runtime.stages import Stage


def prefill_slot(traffic: Traffic, stages: Mapping[int, Stage], b: int, seq: SlotSequence) -> torch.Tensor | None:
    """Slot `b`'s prompt `[1, P]` through every stage in order (the `stages` hosted here run it), then each stage's
    anchors `[P, A_s, H]` to the PDM, which starts the slot and stores them where it is hosted. Returns the last
    stage's logits of position P-1 where that stage is hosted, else None."""
    box, clock, drafter = traffic.box, traffic.clock, traffic.drafter
    prompt = torch.tensor([list(seq.request.prompt_ids)], dtype=torch.long, device=box.device)
    if drafter is not None:
        drafter.start(b, prompt, seq.capacity, seq.request.sampling, generator_seeds(seq.request.seed)[1])
    n, P, H = traffic.n, prompt.shape[1], box.hidden_size
    hidden, anchors, logits = None, {}, None
    for s in range(1, n + 1):
        if s in stages:
            # logits: the last stage's (the stages before it give None)
            with clock.span(s - 1, COMPUTE, device_work=True):
                hidden, anchors[s], logits = stages[s].prefill(b, prompt if s == 1 else hidden, seq.capacity)
        if s < n:
            traffic.send(s - 1, s, "act_prefill", hidden)
            hidden = traffic.recv(s - 1, s, "act_prefill", box.prefill_buffer(s, "act", 1, 1, P, H))
    for s, count in box.anchor_counts.items():
        if count:
            traffic.send(s - 1, n, "anchors_prefill", anchors.get(s))
            states = traffic.recv(s - 1, n, "anchors_prefill", box.prefill_buffer(n, f"anchors{s}", 0, P, count, H))
            if states is not None:
                drafter.store_anchors(b, s, 0, states)
    return logits
