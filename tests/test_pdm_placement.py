"""PDM placement `shared`: the PDM in stage 1's process, n processes for n stages, the same decode; its
draft on a second CUDA stream (`shared_stream`), and what sharing costs in the cycle profile."""

from contextlib import contextmanager, nullcontext

import pytest
import torch
from kit import make_tiny_model, save_random_drafter, target_dir

from inference.cycle.result import COMPUTE, TIMING_FIELDS, summarize_timing
from inference.cycle.simulator import Simulator
from inference.processes.job import DecodeJob
from inference.processes.launch import launch
from inference.runtime import shared_stream
from inference.runtime.shared_stream import SideStreamDrafter, draft_stream, use_stream
from inference.sampling import Sampling
from spd_lightning.export import load_drafter
from spd_lightning.geometry import Geometry

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]
PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8]]


@pytest.mark.parametrize(
    "n, mode, sampling",
    [(3, "spd", Sampling()), (2, "spd", Sampling(1.0, 20, 0.9)), (2, "post_step", Sampling())],
    ids=["n3-greedy", "n2-sampled", "n2-post-step"],
)
def test_shared_placement_decodes_what_the_separate_one_and_the_simulator_do(
    tmp_path_factory, tmp_path, n, mode, sampling
):
    path, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    geometry = Geometry.build(target.num_layers, n).with_mode(mode)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))

    def job(placement: str) -> DecodeJob:
        return DecodeJob(
            path,
            geometry.to_dict(),
            PROMPTS,
            16,
            [],
            target.vocab_size,
            target.hidden_size,
            sampling.to_dict(),
            drafter_path=drafter,
            seed=5,
            timeout_s=60,
            pdm_placement=placement,
            profile=True,
        )

    shared_job = job("shared")
    assert shared_job.world_size == n and job("separate").world_size == n + 1
    shared, separate = launch(shared_job), launch(job("separate"))
    simulator = Simulator(target, load_drafter(drafter)[0], geometry, sampling)
    for i, (a, b) in enumerate(zip(shared, separate)):
        simulated = simulator.decode(PROMPTS[i], 16, seed=5 + i)
        assert (a.tokens, a.N, a.K, a.counters) == (b.tokens, b.N, b.K, b.counters)
        assert (a.tokens, a.K) == (simulated.tokens, simulated.K)
        for result in (a, b):  # the cycle profile: every stage's compute and the PDM's draft, per cycle
            per_cycle = result.timing["per_cycle"]
            assert len(per_cycle["wall_s"]) == result.K and all(len(r) == n for r in per_cycle["stage_compute_s"])
            assert result.timing["totals"]["draft_s"] > 0 and result.timing["totals"]["comm_s"] > 0
        shared_cost = a.timing["per_cycle"]["shared_process_s"]  # only the shared placement reports it
        assert len(shared_cost) == a.K and "shared_process_s" not in b.timing["per_cycle"]


def test_the_sharing_cost_is_stage_1_plus_the_draft_beyond_the_slowest_stage():
    rows = torch.zeros(3, 2, TIMING_FIELDS)  # n = 2 stages and the PDM, 2 cycles
    rows[0, :, COMPUTE] = torch.tensor([1.0, 1.0])  # stage 1
    rows[1, :, COMPUTE] = torch.tensor([3.0, 1.5])  # stage 2
    rows[2, :, COMPUTE] = torch.tensor([0.5, 2.0])  # the PDM's draft on stage 1's critical path
    timing = summarize_timing(rows, 2, 2, shared_pdm=True)
    assert timing["per_cycle"]["shared_process_s"] == [1.5, 3.0]
    assert timing["per_cycle"]["sharing_cost_s"] == [0.0, 1.5]
    assert timing["totals"]["mean_sharing_cost_s"] == 0.75 and timing["totals"]["mean_shared_process_s"] == 2.25
    assert "sharing_cost_s" not in summarize_timing(rows, 2, 2)["per_cycle"]


def test_the_draft_gets_its_own_stream_on_a_gpu_and_none_on_the_cpu(monkeypatch):
    assert draft_stream(torch.device("cpu")) is None and isinstance(use_stream(None), nullcontext)
    made, entered = [], []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or "stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: entered.append(stream) or nullcontext())
    assert draft_stream(torch.device("cuda", 1)) == "stream" and made == [torch.device("cuda", 1)]
    with use_stream("stream"):
        assert entered == ["stream"]


class FakeStream:
    """Logs what is asked of a CUDA stream; its events are numbered."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def record_event(self) -> str:
        event = f"e{sum(1 for entry in self.log if entry[0] == 'record')}"
        self.log.append(("record", self.name, event))
        return event

    def wait_event(self, event: str) -> None:
        self.log.append(("wait", self.name, event))


class FakeTensor:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def record_stream(self, stream: FakeStream) -> None:
        self.log.append(("used by", stream.name, self.name))


class FakeDrafter:
    def __init__(self, log: list):
        self.log = log

    def start(self, prompt_ids, capacity):
        self.log.append(("start",))

    def set_token(self, position, token):
        self.log.append(("set_token",))

    def store_anchors(self, stage, start, states):
        self.log.append(("store_anchors",))

    def draft(self, view, generator):
        self.log.append(("draft",))
        return FakeTensor("token", self.log), FakeTensor("q", self.log)


def test_the_side_stream_waits_for_the_inputs_and_the_main_stream_for_the_draft(monkeypatch):
    log = []
    main, side = FakeStream("main", log), FakeStream("side", log)

    @contextmanager
    def on(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    monkeypatch.setattr(shared_stream, "use_stream", on)
    drafter = SideStreamDrafter(FakeDrafter(log), side, main_stream=lambda: main)
    drafter.start(None, 8)
    drafter.store_anchors(1, 0, None)
    drafter.set_token(3, 5)
    token, q = drafter.draft([(0, 3)], None)
    assert (token.name, q.name) == ("token", "q")
    assert log == [
        ("start",),
        ("record", "main", "e0"),
        ("store_anchors",),
        ("record", "main", "e1"),
        ("set_token",),
        ("record", "main", "e2"),
        ("wait", "side", "e2"),  # the latest input, not the forward launched after it
        ("enter", "side"),
        ("draft",),
        ("exit", "side"),
        ("record", "side", "e3"),
        ("wait", "main", "e3"),
        ("used by", "main", "token"),
        ("used by", "main", "q"),
    ]


def test_without_a_stream_the_same_drafter_runs_in_line():
    log = []
    drafter = SideStreamDrafter(FakeDrafter(log), None)
    drafter.store_anchors(1, 0, None)
    drafter.draft([(0, 3)], None)
    assert log == [("store_anchors",), ("draft",)]
