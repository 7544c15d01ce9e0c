"""PDM placement `shared`: the PDM in stage 1's process, n processes for n stages, the same decode; its
draft on a second CUDA stream (`shared_stream`), and what sharing costs in the cycle profile."""

from collections import deque
from contextlib import contextmanager, nullcontext

import pytest
import torch
from kit import LateArrival, RecordingTransport, make_tiny_model, random_pdm, save_random_drafter, target_dir

from inference.cycle.pipeline import PipelineRunner
from inference.cycle.result import COMPUTE, TIMING_FIELDS, summarize_timing
from inference.cycle.simulator import Simulator
from inference.cycle.slots import Request
from inference.cycle.transport import Arrival, LocalTransport, Transport
from inference.processes.job import DecodeJob
from inference.processes.launch import launch
from inference.runtime import shared_stream
from inference.runtime.drafter import DraftBatch
from inference.runtime.shared_stream import SideStreamDrafter, draft_stream, use_stream
from inference.runtime.stages import Stage
from inference.sampling import Sampling
from spd_lightning.export import load_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.host_syncs import HostSyncCounter

pytestmark = pytest.mark.timeout(180)
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
            geometry,
            PROMPTS,
            16,
            [],
            target.vocab_size,
            target.hidden_size,
            sampling,
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
    timing = summarize_timing(rows, 2, shared_pdm=True)
    assert timing["per_cycle"]["shared_process_s"] == [1.5, 3.0]
    assert timing["per_cycle"]["sharing_cost_s"] == [0.0, 1.5]
    assert timing["totals"]["mean_sharing_cost_s"] == 0.75 and timing["totals"]["mean_shared_process_s"] == 2.25
    assert "sharing_cost_s" not in summarize_timing(rows, 2)["per_cycle"]


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

    def start(self, slot, prompt_ids, capacity, sampling, seed):
        self.log.append(("start",))

    def set_token(self, slot, position, token):
        self.log.append(("set_token",))

    def store_anchors(self, slot, stage, start, states):
        self.log.append(("store_anchors",))

    def draft(self, views, rows=None):
        self.log.append(("draft",))
        return DraftBatch(FakeTensor("token", self.log), FakeTensor("q", self.log))


@pytest.fixture
def fake_streams(monkeypatch):
    """A shared log, a main and a side `FakeStream`, and `use_stream` logging when a stream is entered and left."""
    log = []

    @contextmanager
    def on(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    monkeypatch.setattr(shared_stream, "use_stream", on)
    return log, FakeStream("main", log), FakeStream("side", log)


def test_the_side_stream_waits_for_the_inputs_and_the_main_stream_for_the_draft(fake_streams):
    log, main, side = fake_streams
    drafter = SideStreamDrafter(FakeDrafter(log), side, main_stream=lambda: main)
    drafter.start(0, None, 8, Sampling(), 0)
    drafter.store_anchors(0, 1, 0, None)
    drafter.set_token(0, 3, 5)
    token, q = drafter.draft({0: [(0, 3)]})
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
    drafter.store_anchors(0, 1, 0, None)
    drafter.draft({0: [(0, 3)]})
    assert log == [("store_anchors",), ("draft",)]


def test_receiving_runs_on_the_side_stream_after_the_inputs_and_the_main_stream_waits_for_it(fake_streams):
    log, main, side = fake_streams
    drafter = SideStreamDrafter(FakeDrafter(log), side, main_stream=lambda: main)
    drafter.set_token(0, 3, 5)
    log.append(("forward",))  # stage 1's forward, launched on the main stream after the inputs
    with drafter.receiving():
        drafter.store_anchors(0, 2, 2, None)  # no event on the main stream: it is written on the side stream
    drafter.draft({0: [(0, 3)]})
    assert log[: log.index(("draft",))] == [
        ("set_token",),
        ("record", "main", "e0"),
        ("forward",),
        ("wait", "side", "e0"),  # the inputs recorded before the forward, not the forward
        ("enter", "side"),
        ("store_anchors",),
        ("exit", "side"),
        ("record", "side", "e1"),
        ("wait", "main", "e1"),  # the main stream's next work sees the stored states, drafted or not
        ("wait", "side", "e0"),
        ("enter", "side"),
    ]


class SharedRank(Transport):
    """Process 0 of the shared placement alone over a recorded run: stage 1 (rank 0) and the PDM (rank n)
    exchange their messages in the process; what the other processes sent is replayed from the recording,
    and `events` logs each receive from them."""

    def __init__(self, n: int, log, events: list, verdict_in_time: bool):
        self.n, self.events, self.verdict_in_time = n, events, verdict_in_time
        self.local = LocalTransport(n + 1)
        self.sent: list[tuple[int, int, str, torch.Tensor]] = []
        self.queues: dict[tuple[int, int], deque] = {}
        for src, dst, kind, tensor in log:
            if dst in (0, n) and not self.hosts(src):
                self.queues.setdefault((src, dst), deque()).append((kind, tensor))

    def hosts(self, rank: int) -> bool:
        return rank in (0, self.n)

    def send(self, src, dst, tensor, kind) -> None:
        self.sent.append((src, dst, kind, tensor.clone()))
        if self.hosts(dst):
            self.local.send(src, dst, tensor, kind)

    def _replay(self, src, dst, tensor, kind) -> None:
        sent_kind, payload = self.queues[src, dst].popleft()
        assert sent_kind == kind, f"rank {dst} expects {kind} from {src}, the recorded run sent {sent_kind}"
        tensor.copy_(payload)

    def recv(self, src, dst, tensor, kind) -> None:  # blocks the host until the message is in
        if self.hosts(src):
            return self.local.recv(src, dst, tensor, kind)
        self.events.append(("recv", kind))
        self._replay(src, dst, tensor, kind)

    def post(self, src, dst, tensor, kind) -> Arrival:  # does not block
        if self.hosts(src):
            return self.local.post(src, dst, tensor, kind)
        self._replay(src, dst, tensor, kind)
        return Arrival() if self.verdict_in_time else LateArrival()


@pytest.mark.parametrize(
    "sampling, verdict_in_time",
    [(Sampling(), True), (Sampling(1.0, top_k=20), False)],
    ids=["greedy-verdict-early", "sampled-verdict-late"],
)
def test_the_shared_process_launches_stage_1_before_it_waits_for_another_process(
    tiny_qwen35, monkeypatch, sampling, verdict_in_time
):
    """Process 0 of the shared placement, alone over a recorded simulator run: in every step it launches
    stage 1's forward before it receives anything from another process (the other stages' pre-step anchor
    states come after it), makes no host sync between that forward and the draft, and its draft stream
    waits only on events recorded before the forward. It sends exactly what ranks 0 and n of the recorded
    run sent (every draft identical), and decodes the same tokens."""
    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator = Simulator(tiny_qwen35, random_pdm(tiny_qwen35, geometry, num_layers=1), geometry, sampling)
    recording = RecordingTransport(geometry.n + 1)
    simulator.transport = recording
    want = simulator.decode(PROMPTS[0], 24, seed=3)
    assert want.K > want.N  # rejections and refills

    events = []
    main, side = FakeStream("main", events), FakeStream("side", events)

    @contextmanager
    def on(stream):
        events.append(("enter", stream.name))
        yield
        events.append(("exit", stream.name))

    monkeypatch.setattr(shared_stream, "use_stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: None, raising=False)
    pdm = simulator.drafter
    drafter = SideStreamDrafter(pdm, side, main_stream=lambda: main)
    stage = Stage.from_target(tiny_qwen35, geometry, 1)
    transport = SharedRank(geometry.n, recording.log, events, verdict_in_time)
    runner = PipelineRunner(geometry, transport, {1: stage}, drafter, simulator.config)
    forward, draft, cycle = stage.step, pdm.draft, runner.step

    def logged(name, fn):
        def call(*args, **kwargs):
            events.append((name, len(counter.records)))
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(stage, "step", logged("forward", forward))
    monkeypatch.setattr(pdm, "draft", logged("draft", draft))
    monkeypatch.setattr(runner, "step", logged("step", cycle))
    with HostSyncCounter(device="cpu") as counter:
        got = runner.run_one(Request(PROMPTS[0], 24, frozenset(), sampling, seed=3))
    assert (got.tokens, got.K, got.counters) == (want.tokens, want.K, want.counters)
    recorded = [(s, d, k, t) for s, d, k, t in recording.log if transport.hosts(s)]
    assert [m[:3] for m in transport.sent] == [m[:3] for m in recorded]
    assert all(torch.equal(a[3], b[3]) for a, b in zip(transport.sent, recorded))

    starts = [i for i, e in enumerate(events) if e[0] == "step"] + [len(events)]
    steps = [events[a:b] for a, b in zip(starts, starts[1:])]
    both = [step for step in steps if any(e[0] == "forward" for e in step) and any(e[0] == "draft" for e in step)]
    assert len(both) > want.K // 2
    anchors_after = 0
    for step in both:
        names = [e[0] for e in step]
        at_forward, at_draft = names.index("forward"), names.index("draft")
        received = [i for i, e in enumerate(step) if e[0] == "recv"]
        assert all(i > at_forward for i in received), step  # stage 1 waits for no other process
        anchors = [i for i in received if step[i][1].startswith("anchors")]
        assert all(i < at_draft for i in anchors), step  # the draft reads them
        anchors_after += bool(anchors)
        syncs = counter.records[step[at_forward][1] : step[at_draft][1]]
        assert not [s for s in syncs if not (s.kind == "to_device" and "site-packages" in s.site)], syncs
        # the draft stream never waits on an event recorded on the main stream after the forward
        after = {e[2] for e in step[at_forward:at_draft] if e[:2] == ("record", "main")}
        assert not [e for e in step[at_forward : at_draft + 1] if e[:2] == ("wait", "side") and e[2] in after], step
    assert anchors_after > len(both) // 4  # the steps in which other stages had run a token
