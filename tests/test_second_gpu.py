"""A decoder on `cuda:N`, N >= 1, in a process whose current device is still cuda:0 (the simulator, `decode
--simulate --device cuda:1`, a library user): every event that orders or times its work is recorded on its own
device's stream. An event recorded without a stream goes on the current device's, where none of that work runs, so
the host would read the verdict or a slot table before its copy landed.

There is no GPU here: tensors "on" cuda:1 are made on the CPU (`OnTheCpu`), and `torch.cuda.Event` and
`torch.cuda.current_stream` are stand-ins that log the device of the stream each event is recorded on.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from inference.cycle.messages import Mailboxes
from inference.cycle.profiler import Profiler
from inference.cycle.result import COMPUTE
from inference.runtime.slot_rows import HostTable
from spd_lightning.geometry import Geometry

GPU = torch.device("cuda", 1)


class OnTheCpu(TorchFunctionMode):
    """Factory functions asked for a CUDA device or pinned memory make plain CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


@pytest.fixture
def recorded_on(monkeypatch):
    """The devices of the streams events were recorded on, with cuda:0 the current device."""
    devices = []

    def current_stream(device=None):
        return SimpleNamespace(device=torch.device("cuda", 0) if device is None else torch.device(device))

    class Event:
        def __init__(self, enable_timing: bool = False):
            pass

        def record(self, stream=None):  # as torch.cuda.Event.record: no stream is the current device's
            devices.append((stream or torch.cuda.current_stream()).device)

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return 1.0

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    with OnTheCpu():
        yield devices


def test_a_host_table_on_cuda_1_records_its_upload_there(recorded_on):
    table = HostTable(2, 3, GPU)
    table.writable()[:] = 7
    assert table.upload(2).tolist() == [[7] * 3] * 2
    table.writable()
    assert recorded_on == [GPU]


def test_the_verdict_read_on_cuda_1_waits_for_the_copy_there(recorded_on):
    geometry = Geometry.build(4, 2)
    box = Mailboxes(geometry, [1], hidden_size=8, state_dtype=torch.float32, draft_vocab_size=5, slots=2, device=GPU)
    box.verdict_rows[0] = torch.tensor([[1, 11], [2, 22]])
    assert box.verdict_to_host(0) == [[1, 11], [2, 22]]
    assert recorded_on == [GPU]


def test_the_profiler_on_cuda_1_times_the_work_there(recorded_on):
    clock = Profiler(True, GPU)
    clock.start(2, 1)
    with clock.span(0, COMPUTE, device_work=True):
        pass
    assert clock.rows[0, 0, COMPUTE] == pytest.approx(1e-3)
    assert recorded_on == [GPU, GPU]
