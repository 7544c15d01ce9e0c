"""The verdict channel: the verifier's `[B, 2]` verdict rows of a step (`judge`: `[verdict, token]` per slot, one
host read and one message on the gloo control group per step in which it judged some slot) and their delivery to
the other ranks of a process (docs/DESIGN.md, "One cycle over B slots"). The rows of slots not judged are stale and
never read. A join's first token travels the same way (`send_first`). Every process holds the rows of the steps it
has taken (`rows`); the verifier's process holds them as soon as it judged.

The other ranks hosted here (the listeners) do not know at the end of a step whether a message was sent in it
when a slot's step was judged but might have been wasted: that is known only once the previous verdict is in. So
each step that may have one is owed (`Judging`), and a listener takes the owed messages in order, dropping the
steps in which none was sent (`_due`). A step posts the receive of the previous step's verdict (`post`); the PDM
drafts without it when it is late (`late`), and every process takes it by the end of the step (`take_through`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from inference.cycle.result import VERIFY
from inference.cycle.schedule import Steps, Verdict, VerdictMessage
from inference.cycle.slots import SlotSequence
from inference.cycle.traffic import Traffic
from inference.cycle.transport import Arrival


@dataclass
class Judging:
    """What a process knows at the end of `step` of whether the verifier judged in it: surely (`real`), or if one
    of the slots `unknown` (slot, its `Steps`) turns out real once the previous step's verdict is in."""

    step: int
    real: bool
    unknown: list[tuple[int, Steps]]


class VerdictChannel:
    """The verdicts of one process: the verifier's judging and sends where it is hosted, the listeners' receives."""

    def __init__(self, traffic: Traffic, verifier_rank: int):
        self.traffic, self.verifier_rank = traffic, verifier_rank
        self.hosts_verifier = traffic.transport.hosts(verifier_rank)
        self.others = [r for r in range(traffic.n + 1) if r != verifier_rank]  # every rank the verifier sends to
        self.listeners = [r for r in self.others if traffic.transport.hosts(r)]
        self.rows: dict[int, list[list[int]]] = {}  # step -> its verdict rows, once this process holds them
        self._owed: deque[Judging] = deque()  # steps whose message the listeners may not have taken yet (`_due`)
        self._arrivals: dict[int, Arrival] = {}  # listener rank -> its posted receive of the oldest owed verdict

    def message(self, step: int, b: int) -> VerdictMessage | None:
        """Slot `b`'s verdict of `step`, when this process holds it."""
        rows = self.rows.get(step)
        return None if rows is None else VerdictMessage(*rows[b])

    def send_first(self, b: int, token: int) -> int:
        """A join's first token for slot `b` (sampled where the verifier is hosted, else -1) to every other rank;
        returns it as this process knows it. The rows of other slots are stale: their receivers read only row
        `b`."""
        first = self.traffic.box.first_host
        first[b, 0], first[b, 1] = Verdict.FIRST, token
        for r in self.others:
            self.traffic.send(self.verifier_rank, r, "verdict", first)
        for r in self.listeners:
            self.traffic.recv(self.verifier_rank, r, "verdict")
            if not self.hosts_verifier:
                verdict, token = self._read_verdict(r)[b]
                if verdict != Verdict.FIRST:
                    raise RuntimeError(f"protocol error: slot {b}'s first message is {Verdict(verdict).name}")
        return token

    def judge(self, step: int, live: Mapping[int, SlotSequence], logits: torch.Tensor | None) -> None:
        """The verifier judges each real slot's draft of `step` into its device row, read and sent to every other
        rank at once (none of it in a step that judged no slot); the listeners may owe that message."""
        real, unknown = [], []
        for b, seq in live.items():
            if seq.step.plan.judged_position >= 0:
                wasted = seq.wasted(self.message(step - 1, b))
                if wasted is None:
                    unknown.append((b, seq.steps))
                elif not wasted:
                    real.append(b)
        if self.hosts_verifier and real:
            box = self.traffic.box
            index = step % 2  # a row pair is rewritten two steps later, once its sends have settled
            rows = box.verdict_rows[index]
            with self.traffic.clock.span(self.verifier_rank, VERIFY, device_work=True):
                for b in real:
                    live[b].judge(logits[b], rows[b])
            self.rows[step] = box.verdict_to_host(index)
            for r in self.others:
                self.traffic.send(self.verifier_rank, r, "verdict", box.verdict_host[index])
        if self.listeners and (real or unknown):
            self._owed.append(Judging(step, bool(real), unknown))

    def post(self, step: int) -> None:
        """The listeners start receiving the verdict of `step`, if it is still owed."""
        if self._owed_head() == step:
            for r in self.listeners:
                self._arrivals[r] = self.traffic.post(self.verifier_rank, r, "verdict")

    def late(self, rank: int) -> bool:
        """Whether `rank`'s posted receive of a verdict is not in yet."""
        arrival = self._arrivals.get(rank)
        return arrival is not None and not arrival.ready()

    def take_through(self, step: int) -> None:
        """The listeners take every owed verdict message up to that of `step` (waiting for them)."""
        while (head := self._owed_head()) is not None and head <= step:
            self._take_verdict()

    def keep_from(self, step: int) -> None:
        """Forget the rows of the steps before `step`."""
        self.rows = {s: v for s, v in self.rows.items() if s >= step}

    def _take_verdict(self) -> None:
        """The listeners take the oldest owed verdict message (waiting for it); its rows are this process's."""
        step = self._owed.popleft().step
        for r in self.listeners:
            arrival = self._arrivals.pop(r, None)
            if arrival is None:
                self.traffic.recv(self.verifier_rank, r, "verdict")
            else:
                self.traffic.wait(r, arrival)
        if not self.hosts_verifier:  # the verifier's process made them
            self.rows[step] = self._read_verdict(self.listeners[0])

    def _read_verdict(self, rank: int) -> list[list[int]]:
        """The `[B, 2]` verdict rows `rank` received, read once per message (host memory: no device sync)."""
        return self.traffic.box.inbox[rank, "verdict"].tolist()

    def _owed_head(self) -> int | None:
        """The oldest step whose verdict message is still to be taken (steps without one dropped)."""
        while self._owed and not self._due(self._owed[0]):
            self._owed.popleft()
        return self._owed[0].step if self._owed else None

    def _due(self, judging: Judging) -> bool:
        """Whether the verifier sent a verdict message in that step: it did iff it judged some slot, i.e. a slot
        with a judged position ran a real step. A slot not known to be real then awaited the previous step's
        verdict, which this process has taken by the time it asks."""
        if judging.real:
            return True
        rows = self.rows[judging.step - 1]
        return any(not steps.wasted(*rows[b]) for b, steps in judging.unknown)
