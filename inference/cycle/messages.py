"""The runner's message buffers: every point-to-point message has a fixed shape, allocated once per runner
(docs/DESIGN.md, "The hot path: fixed messages, one host read per cycle", which lists every message and why a
buffer of a send ring is never rewritten in flight).

`inbox[rank, kind]` receives; what a rank sends comes from a ring of `SEND_RING` buffers per kind, one buffer per
step in turn (`put`); the compiled step's own outputs, which its next replay overwrites, are never sent. The
verdict lives twice: the verifier judges into a device row, and the message travels from host memory
(`transport.CONTROL_KINDS`, `verdict_to_host`). Prefill buffers grow with the prompt (`prefill_buffer`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from inference.runtime.slot_rows import leading
from spd_lightning.geometry import Geometry

SEND_RING = 3


class Mailboxes:
    """The buffers of the ranks `hosted` here; every message carries one row per slot (`slots`)."""

    def __init__(
        self,
        geometry: Geometry,
        hosted: Collection[int],
        *,
        hidden_size: int,
        state_dtype: torch.dtype,
        draft_vocab_size: int,
        slots: int,
        device: torch.device,
    ):
        n, H = geometry.n, hidden_size
        long, state = dict(dtype=torch.long, device=device), dict(dtype=state_dtype, device=device)
        self.dtype, self.device, self.hidden_size, self.slots = state_dtype, device, H, slots
        # stage -> the anchor states it sends the PDM per step (anchor 0, the embedding output, is not sent)
        anchor_counts = self.anchor_counts = {
            s: len([b for b in geometry.anchors_of_stage(s) if b > 0]) for s in range(1, n + 1)
        }
        self.inbox: dict[tuple[int, str], torch.Tensor] = {}
        self.rings: dict[tuple[int, str], torch.Tensor] = {}
        for r in hosted:
            if 0 < r < n:
                self.inbox[r, "act"] = torch.zeros(slots, 1, H, **state)
            if r in (0, n - 1):
                self.inbox[r, "draft_token"] = torch.zeros(slots, **long)
            if r == n - 1:
                self.inbox[r, "draft_q"] = torch.zeros(slots, draft_vocab_size, device=device)
            if r != n - 1:
                self.inbox[r, "verdict"] = torch.zeros(slots, 2, dtype=torch.long, device="cpu")
            if r == n:
                for s, count in anchor_counts.items():
                    self.inbox[r, f"anchors{s}"] = torch.zeros(slots, count, H, **state)
                self.rings[r, "draft_token"] = torch.zeros(SEND_RING, slots, **long)
                self.rings[r, "draft_q"] = torch.zeros(SEND_RING, slots, draft_vocab_size, device=device)
                # the PDM's drafts as last sent: a discarded draft's row keeps its slot's (`Traffic.put_drafts`)
                self.drafts = torch.zeros(slots, **long), torch.zeros(slots, draft_vocab_size, device=device)
            else:
                count = anchor_counts[r + 1]
                self.rings[r, "act"] = torch.zeros(SEND_RING, slots, 1, H, **state)
                self.rings[r, f"anchors{r + 1}"] = torch.zeros(SEND_RING, slots, count, H, **state)
        # each ring's buffers as views made once (a step picks one without a tensor op)
        self._ring_buffers = {key: ring.unbind(0) for key, ring in self.rings.items()}
        self.outbox: dict[tuple[int, str], torch.Tensor] = {}  # kind -> the ring buffer to send
        self.prefill_inbox: dict[tuple[int, str], torch.Tensor] = {}
        # Two rows in turn (one verdict per cycle), so a row is rewritten only after its sends have settled.
        self.verdict_rows = torch.zeros(2, slots, 2, **long)
        pinned = device.type == "cuda"
        # ... and a third host row for the first tokens of joins (each join writes only its own slot's row)
        self.verdict_host = torch.zeros(3, slots, 2, dtype=torch.long, device="cpu", pin_memory=pinned)
        self.first_host = self.verdict_host[2]
        self._verdict_copied = torch.cuda.Event() if pinned else None
        self.seed_input = torch.zeros(slots, 1, **long)  # stage 1's input when it runs a seed (first token, correction)
        self._step = 0

    def verdict_to_host(self, index: int) -> list:
        """The verifier's verdict row `index` copied to its host row (the message it sends) and read: the
        decode's one device-to-host read per judged cycle. Pinned memory and an event: the host waits for
        this copy alone. One `[verdict, token]` row per slot."""
        host = self.verdict_host[index]
        host.copy_(self.verdict_rows[index], non_blocking=self._verdict_copied is not None)
        if self._verdict_copied is not None:
            self._verdict_copied.record(torch.cuda.current_stream(self.device))  # the copy's stream, not cuda:0's
            self._verdict_copied.synchronize()
        return host.tolist()

    def next_step(self) -> None:
        self._step += 1

    def put(self, rank: int, kind: str, value: torch.Tensor, rows: int | None = None) -> None:
        """Copy a computed output into this step's buffer of its send ring; the next step sends it. `rows`: the
        output covers the leading rows of a batched message only (a step over a bucket of the slots)."""
        buffer = self._ring_buffers[rank, kind][self._step % SEND_RING]
        target = buffer if rows is None else leading(buffer, rows)
        target.copy_(value if value.shape == target.shape else value.view(target.shape))
        self.outbox[rank, kind] = buffer

    def prefill_buffer(self, rank: int, kind: str, dim: int, *shape: int) -> torch.Tensor:
        """A receive buffer of `shape`, whose dimension `dim` counts the prompt's positions: a contiguous view of
        one that grows (never shrinks) with the longest prompt seen."""
        buffer = self.prefill_inbox.get((rank, kind))
        if buffer is None or buffer.shape[dim] < shape[dim]:
            buffer = self.prefill_inbox[rank, kind] = torch.empty(*shape, dtype=self.dtype, device=self.device)
        return buffer.narrow(dim, 0, shape[dim])
