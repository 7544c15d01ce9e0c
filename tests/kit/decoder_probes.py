"""Probes into a decoder run (tests/test_hot_path.py, tests/test_pdm_placement.py, tests/test_compiled_decode.py):
a transport that records every message, a message that arrives late, and a ban on device synchronisation."""

import torch

from inference.cycle.transport import Arrival, LocalTransport


class RecordingTransport(LocalTransport):
    """The simulator's transport, keeping a copy of every message in the order it was sent."""

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.log: list[tuple[int, int, str, torch.Tensor]] = []

    def send(self, src, dst, tensor, kind) -> None:
        super().send(src, dst, tensor, kind)
        self.log.append((src, dst, kind, tensor.clone()))


class LateArrival(Arrival):
    """A message that has not arrived yet when first asked (a verdict later than the next step)."""

    def ready(self) -> bool:
        return False


def forbid_device_sync(monkeypatch):
    """Make torch.cuda.synchronize and torch.cuda.Event raise: a decode that is not timed must touch neither."""

    def refuse(*args, **kwargs):
        raise AssertionError("the untimed decode touched torch.cuda.synchronize / Event")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda, "Event", refuse)
