"""The decode hot path reads nothing from tensors on the host but the verdict, once per cycle, and never
synchronizes the device unless timing is asked for (issue 17.3).

Host reads (`.item()`, `.tolist()`, `int()`, `bool()`, `float()`, `__index__` of a tensor) are counted per
step. A stage rank of the distributed decoder is run alone, over a transport that replays what a recorded
simulator run delivered to it, so its own reads are counted exactly as that rank's process would make them.
"""

from collections import deque
from contextlib import contextmanager

import pytest
import torch
from kit import random_pdm
from test_compiled_decode import forbid_device_sync

from inference.cycle.ar import ar_decode
from inference.cycle.pipeline import PipelineRunner
from inference.cycle.simulator import Simulator
from inference.cycle.transport import Arrival, LocalTransport, Transport
from inference.cycle.verify import Verifier
from inference.runtime.drafter import ReplayDrafter
from inference.runtime.stages import Stage
from inference.sampling import Sampling

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded

PROMPT = [3, 14, 15, 92, 65, 35]
READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")


@contextmanager
def host_reads(monkeypatch):
    """Every host read of a tensor while inside: a list of the tensors read (appended to as they happen)."""
    seen = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            seen.append(self)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        yield seen
    finally:
        monkeypatch.undo()


class Recording(LocalTransport):
    """The simulator's transport, keeping a copy of every message in the order it was sent."""

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.log: list[tuple[int, int, str, torch.Tensor]] = []

    def send(self, src, dst, tensor, kind) -> None:
        super().send(src, dst, tensor, kind)
        self.log.append((src, dst, kind, tensor.clone()))


class _Late(Arrival):
    def ready(self) -> bool:
        return False


class OneRank(Transport):
    """Hosts one rank of a recorded run: receives replay what that run delivered to it, sends go nowhere.
    `verdict_in_time`: whether a posted receive of the verdict is already in when the rank asks."""

    def __init__(self, rank: int, log, verdict_in_time: bool):
        self.rank, self.verdict_in_time = rank, verdict_in_time
        self.queues: dict[int, deque] = {}
        for src, dst, kind, tensor in log:
            if dst == rank:
                self.queues.setdefault(src, deque()).append((kind, tensor))

    def hosts(self, rank: int) -> bool:
        return rank == self.rank

    def send(self, src, dst, tensor, kind) -> None:
        pass

    def recv(self, src, dst, tensor, kind) -> None:
        sent_kind, payload = self.queues[src].popleft()
        assert sent_kind == kind, f"rank {dst} expects {kind} from {src}, the recorded run sent {sent_kind}"
        tensor.copy_(payload)

    def post(self, src, dst, tensor, kind) -> Arrival:
        self.recv(src, dst, tensor, kind)
        return Arrival() if self.verdict_in_time else _Late()


def reads_per_step(runner: PipelineRunner, seen: list) -> list[list[torch.Tensor]]:
    """Wrap `runner._cycle`: the tensors read in each step (the drafter's reads, on the PDM rank, included)."""
    steps, cycle = [], runner._cycle

    def counted(step):
        start = len(seen)
        try:
            return cycle(step)
        finally:
            steps.append(seen[start:])

    runner._cycle = counted
    return steps


def is_verdict(runner: PipelineRunner, tensor: torch.Tensor) -> bool:
    buffers = [runner.verdict_host] + [t for (_, kind), t in runner.inbox.items() if kind == "verdict"]
    return any(tensor.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)


def recorded_run(target, geometry, sampling: Sampling):
    """A simulator decode with accepts, rejections and refills, and the messages it exchanged."""
    if sampling.greedy:
        reference = ar_decode(target, PROMPT, 24).tokens
        drafter = ReplayDrafter([reference], "RRWRRRWW", target.vocab_size)
    else:
        drafter = random_pdm(target, geometry, num_layers=1)
    simulator = Simulator(target, drafter, geometry, sampling)
    transport = Recording(geometry.n + 1)
    simulator.runner.transport = transport
    return simulator, simulator.decode(PROMPT, 24, seed=3), transport.log


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0, top_k=20)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("verdict_in_time", [True, False], ids=["verdict_early", "verdict_late"])
def test_a_stage_rank_reads_only_the_verdict_once_per_cycle(tiny_qwen35, monkeypatch, sampling, verdict_in_time):
    from spd_lightning.geometry import Geometry

    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator, want, log = recorded_run(tiny_qwen35, geometry, sampling)
    assert want.counters["rejected_by_fill"] != [0, 0, 0] and sum(want.counters["accepted_by_fill"]) > 0
    for rank in range(geometry.n):
        stage = Stage.from_target(tiny_qwen35, geometry, rank + 1)
        config = simulator.runner.config
        runner = PipelineRunner(geometry, OneRank(rank, log, verdict_in_time), {rank + 1: stage}, None, config)
        forbid_device_sync(monkeypatch)
        with host_reads(monkeypatch) as seen:
            steps = reads_per_step(runner, seen)
            got = runner.decode(PROMPT, 24, frozenset(), seed=3)
        assert (got.tokens, got.K, got.counters) == (want.tokens, want.K, want.counters)
        # at most one verdict per step; the final step also learns its own (the decode ends with it)
        assert all(len(reads) <= 1 for reads in steps[:-1]) and len(steps[-1]) <= 2, [len(r) for r in steps]
        assert all(is_verdict(runner, t) for reads in steps for t in reads)
        # one read per verdict this rank learns in a cycle: every judged cycle's (N - 1 of them) plus the
        # verdict of each rejection's wasted step, which is the rejection itself, read once
        assert sum(map(len, steps)) == want.N - 1


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0, top_k=20)], ids=["greedy", "sampled"])
def test_the_pdm_rank_reads_only_the_verdict_once_per_cycle(tiny_qwen35, monkeypatch, sampling):
    """The PDM rank alone over a recorded run: fusing the in-flight states (one projection per type, the
    types known on the host), drafting and sampling read nothing; only the verdict, once per judged cycle."""
    from spd_lightning.geometry import Geometry

    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator = Simulator(tiny_qwen35, random_pdm(tiny_qwen35, geometry, num_layers=1), geometry, sampling)
    transport = Recording(geometry.n + 1)
    simulator.runner.transport = transport
    want = simulator.decode(PROMPT, 24, seed=3)
    pdm_rank = geometry.n
    runner = PipelineRunner(
        geometry, OneRank(pdm_rank, transport.log, True), {}, simulator.runner.drafter, simulator.runner.config
    )
    forbid_device_sync(monkeypatch)
    with host_reads(monkeypatch) as seen:
        steps = reads_per_step(runner, seen)
        got = runner.decode(PROMPT, 24, frozenset(), seed=3)
    assert (got.tokens, got.K) == (want.tokens, want.K)
    assert all(len(reads) <= 1 for reads in steps[:-1]) and len(steps[-1]) <= 2, [len(r) for r in steps]
    assert all(is_verdict(runner, t) for reads in steps for t in reads)
    assert 0 < sum(map(len, steps)) <= want.N


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, top_p=0.9)], ids=["greedy", "sampled"])
def test_the_simulator_reads_one_verdict_per_judged_cycle(tiny_qwen35, monkeypatch, sampling):
    """All ranks in one process: the verifier's one read of its verdict row is the only host read per step."""
    from spd_lightning.geometry import Geometry

    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator = Simulator(tiny_qwen35, random_pdm(tiny_qwen35, geometry, num_layers=1), geometry, sampling)
    want = simulator.decode(PROMPT, 16, seed=1)
    forbid_device_sync(monkeypatch)
    with host_reads(monkeypatch) as seen:
        steps = reads_per_step(simulator.runner, seen)
        got = simulator.decode(PROMPT, 16, seed=1)
    assert got.tokens == want.tokens and got.K == want.K
    assert all(len(reads) <= 1 for reads in steps) and sum(map(len, steps)) == got.N - 1
    host_row = simulator.runner.verdict_host.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == host_row for reads in steps for t in reads)


def test_the_sampled_verifier_judges_without_host_reads_and_matches_the_target(monkeypatch):
    """The device-side rejection sampler: no host read inside, and its outputs are distributed as P."""
    from kit import random_dist
    from test_sampling_power import chisquare_pvalues

    V, draws = 6, 3000
    p, q = random_dist(V, 3), random_dist(V, 4, zero_frac=0.4)
    verifier = Verifier(Sampling(1.0), 2, V, torch.arange(V), V, torch.device("cpu"))
    verifier.reset(0)
    drafts = torch.multinomial(q, draws, replacement=True, generator=torch.Generator().manual_seed(1))
    out, tokens = torch.zeros(2, dtype=torch.long), torch.zeros(draws, dtype=torch.long)
    with host_reads(monkeypatch) as seen:
        for i in range(draws):
            verifier.remember(i, drafts[i : i + 1], q)
            tokens[i : i + 1].copy_(verifier.judge(i, p.log(), out)[1:])
    assert seen == []
    counts = torch.bincount(tokens, minlength=V)
    assert counts[p == 0].sum() == 0
    assert chisquare_pvalues(counts.numpy(), p.double().numpy())[0] > 1e-3


def test_every_message_travels_in_a_buffer_allocated_once(tiny_qwen35):
    """Per-step messages are sent from the send rings (the verdict from its host rows) and received into the
    same inboxes every step; a shorter prompt reuses the prefill buffers of a longer one."""
    from spd_lightning.geometry import Geometry

    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator = Simulator(tiny_qwen35, random_pdm(tiny_qwen35, geometry, num_layers=1), geometry, Sampling(1.0))
    runner, transport = simulator.runner, simulator.runner.transport
    box = runner.box
    owners = [*box.rings.values(), box.verdict_host]
    sent, received, send, recv = [], [], transport.send, transport.recv

    def recording_send(src, dst, tensor, kind):
        sent.append((kind, tensor.untyped_storage().data_ptr()))
        send(src, dst, tensor, kind)

    def recording_recv(src, dst, tensor, kind):
        received.append((kind, tensor.untyped_storage().data_ptr()))
        recv(src, dst, tensor, kind)

    transport.send, transport.recv = recording_send, recording_recv
    simulator.decode(PROMPT, 12)
    prefill, mark = {kind: ptr for kind, ptr in received if kind.endswith("_prefill")}, len(received)
    simulator.decode(PROMPT[:3], 12)
    per_step = [(kind, ptr) for kind, ptr in sent if not kind.endswith("_prefill")]
    kinds = {kind for kind, _ in per_step}
    assert kinds >= {"act", "draft_token", "draft_q", "verdict"} and any(k.startswith("anchors") for k in kinds)
    assert all(any(ptr == o.untyped_storage().data_ptr() for o in owners) for _, ptr in per_step)
    inboxes = {t.untyped_storage().data_ptr() for t in box.inbox.values()}
    assert all(ptr in inboxes for kind, ptr in received if not kind.endswith("_prefill"))
    again = {kind: ptr for kind, ptr in received[mark:] if kind.endswith("_prefill")}
    assert again == prefill
