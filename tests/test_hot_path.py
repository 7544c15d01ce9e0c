"""The decode hot path makes no host/device synchronization but the verdict's one host read per cycle, and
never synchronizes the device unless timing is asked for (docs/DESIGN.md, "The hot path").

`HostSyncCounter` (spd_lightning/host_syncs.py) sees every kind of sync a GPU would make: scalar reads, copies
to the host, tensors made from Python data (host-to-device copies: `torch.tensor(list, device=...)`, a list
index), data-dependent shapes and indexing with freshly made tensors. A stage rank or the PDM rank of the
distributed decoder is run alone, over a transport that replays what a recorded simulator run delivered to it,
so its own syncs are counted per cycle exactly as that rank's process would make them.
"""

import os
from collections import deque

import pytest
import torch
from kit import LateArrival, RecordingTransport, forbid_device_sync, random_pdm

from inference.cycle.ar import ar_decode
from inference.cycle.pipeline import PipelineRunner
from inference.cycle.simulator import Simulator
from inference.cycle.slots import Request
from inference.cycle.transport import Arrival, Transport
from inference.cycle.verify import Verifier
from inference.runtime.replay import ReplayDrafter
from inference.runtime.stages import Stage
from inference.sampling import Sampling
from spd_lightning.host_syncs import HostSync, HostSyncCounter

PROMPT = [3, 14, 15, 92, 65, 35]
# The one host read a cycle may make: the verifier reads the verdict it made, every other rank the verdict
# it received (host memory).
VERDICT_READS = ("in verdict_to_host", "in _read_verdict")
# transformers moves buffers to the device they already live on (`inv_freq.to(x.device)`,
# `initial_state.to(value)`): no copy on a GPU, but on the CPU the counter cannot tell such a move from a real one.
_SITE_PACKAGES = os.sep + "site-packages" + os.sep


def is_verdict_read(sync: HostSync) -> bool:
    return sync.kind == "to_host" and sync.site.endswith(VERDICT_READS)


def is_sync(sync: HostSync) -> bool:
    """Whether a GPU would wait here (the library's moves to where a tensor already lives do not count)."""
    return not (sync.kind == "to_device" and _SITE_PACKAGES in sync.site)


def syncs_per_step(runner: PipelineRunner, counter: HostSyncCounter) -> list[list[HostSync]]:
    """Wrap `runner.step`: the syncs of each step (the drafter's, on the PDM rank, included)."""
    return batch_syncs_per_step(runner, counter)


def one_rank_runner(geometry, transport, stages: dict, drafter, config) -> PipelineRunner:
    """A batch-1 runner of the ranks `transport` hosts."""
    return PipelineRunner(geometry, transport, stages, drafter, config)


def decode_alone(runner: PipelineRunner, sampling: Sampling):
    return runner.run_one(Request(PROMPT, 24, frozenset(), sampling, seed=3))


def check_only_verdict_reads(steps: list[list[HostSync]]) -> int:
    """Every step syncs only to read a verdict, at most once (the final step also learns its own); returns
    how many verdicts were read."""
    others = [r for syncs in steps for r in syncs if not is_verdict_read(r)]
    assert not others, "\n".join(f"{r.kind} ({r.op}) at {r.site}" for r in others)
    counts = [len(syncs) for syncs in steps]
    assert all(c <= 1 for c in counts[:-1]) and counts[-1] <= 2, counts
    return sum(counts)


class OneRank(Transport):
    """Hosts one rank of a recorded run: receives replay what that run delivered to it, sends go nowhere.
    `verdict_in_time`: whether a posted receive of the verdict is already in when the rank asks."""

    def __init__(self, rank: int, log, verdict_in_time: bool):
        self.rank, self.verdict_in_time = rank, verdict_in_time
        self.sent: list[tuple[int, str, torch.Tensor]] = []
        self.queues: dict[int, deque] = {}
        for src, dst, kind, tensor in log:
            if dst == rank:
                self.queues.setdefault(src, deque()).append((kind, tensor))

    def hosts(self, rank: int) -> bool:
        return rank == self.rank

    def send(self, src, dst, tensor, kind) -> None:
        self.sent.append((dst, kind, tensor.clone()))

    def recv(self, src, dst, tensor, kind) -> None:
        sent_kind, payload = self.queues[src].popleft()
        assert sent_kind == kind, f"rank {dst} expects {kind} from {src}, the recorded run sent {sent_kind}"
        tensor.copy_(payload)

    def post(self, src, dst, tensor, kind) -> Arrival:
        self.recv(src, dst, tensor, kind)
        return Arrival() if self.verdict_in_time else LateArrival()


def recorded_run(target, geometry, sampling: Sampling):
    """A simulator decode with accepts, rejections and refills, and the messages it exchanged."""
    if sampling.greedy:
        reference = ar_decode(target, PROMPT, 24).tokens
        drafter = ReplayDrafter([reference], "RRWRRRWW", target.vocab_size)
    else:
        drafter = random_pdm(target, geometry, num_layers=1)
    simulator = Simulator(target, drafter, geometry, sampling)
    transport = RecordingTransport(geometry.n + 1)
    simulator.transport = transport
    return simulator, simulator.decode(PROMPT, 24, seed=3), transport.log


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0, top_k=20)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("verdict_in_time", [True, False], ids=["verdict_early", "verdict_late"])
def test_a_stage_rank_syncs_only_to_read_the_verdict_once_per_cycle(
    tiny_qwen35, monkeypatch, sampling, verdict_in_time
):
    from spd_lightning.geometry import Geometry

    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator, want, log = recorded_run(tiny_qwen35, geometry, sampling)
    assert want.counters["rejected_by_fill"] != [0, 0, 0] and sum(want.counters["accepted_by_fill"]) > 0
    for rank in range(geometry.n):
        stage = Stage.from_target(tiny_qwen35, geometry, rank + 1)
        config = simulator.config
        runner = one_rank_runner(geometry, OneRank(rank, log, verdict_in_time), {rank + 1: stage}, None, config)
        forbid_device_sync(monkeypatch)
        with HostSyncCounter(device="cpu") as counter:
            steps = syncs_per_step(runner, counter)
            got = decode_alone(runner, sampling)
        assert (got.tokens, got.K, got.counters) == (want.tokens, want.K, want.counters)
        # one read per verdict this rank learns in a cycle: every judged cycle's (N - 1 of them) plus the
        # verdict of each rejection's wasted step, which is the rejection itself, read once
        assert check_only_verdict_reads(steps) == want.N - 1


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0, top_k=20)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("verdict_in_time", [True, False], ids=["verdict_early", "verdict_late"])
def test_the_pdm_rank_syncs_only_to_read_the_verdict_once_per_cycle(
    tiny_qwen35, monkeypatch, sampling, verdict_in_time
):
    """The PDM rank alone over a recorded run: fusing the in-flight states (one projection per type, the
    types known on the host, their positions indexed by device tensors built once), seeding a token, drafting
    and sampling make no sync; only the verdict is read, once per judged cycle. A verdict that is not in yet
    does not hold the draft up: the PDM drafts without it and discards a wasted step's draft, and sends
    exactly what the PDM of the recorded run sent."""
    from spd_lightning.geometry import Geometry

    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator = Simulator(tiny_qwen35, random_pdm(tiny_qwen35, geometry, num_layers=1), geometry, sampling)
    transport = RecordingTransport(geometry.n + 1)
    simulator.transport = transport
    want = simulator.decode(PROMPT, 24, seed=3)
    pdm_rank, drafter = geometry.n, simulator.drafter
    alone = OneRank(pdm_rank, transport.log, verdict_in_time)
    runner = one_rank_runner(geometry, alone, {}, drafter, simulator.config)
    forbid_device_sync(monkeypatch)
    with HostSyncCounter(device="cpu") as counter:
        steps = syncs_per_step(runner, counter)
        got = decode_alone(runner, sampling)
    assert (got.tokens, got.K) == (want.tokens, want.K)
    assert want.K > want.N  # rejections: the PDM seeded corrections (`set_token`) in this run
    assert 0 < check_only_verdict_reads(steps) <= want.N
    recorded = [(dst, kind, t) for src, dst, kind, t in transport.log if src == pdm_rank]
    assert [(d, k) for d, k, _ in alone.sent] == [(d, k) for d, k, _ in recorded]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(alone.sent, recorded))
    assert (runner.discarded_drafts > 0) == (not verdict_in_time)  # late verdicts: wasted drafts were discarded


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, top_p=0.9)], ids=["greedy", "sampled"])
def test_the_simulator_syncs_once_per_judged_cycle(tiny_qwen35, monkeypatch, sampling):
    """All ranks in one process: the verifier's one read of its verdict row is the only sync per step."""
    from spd_lightning.geometry import Geometry

    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator = Simulator(tiny_qwen35, random_pdm(tiny_qwen35, geometry, num_layers=1), geometry, sampling)
    want = simulator.decode(PROMPT, 16, seed=1)
    forbid_device_sync(monkeypatch)
    with HostSyncCounter(device="cpu") as counter:
        steps = syncs_per_step(simulator, counter)
        got = simulator.decode(PROMPT, 16, seed=1)
    assert got.tokens == want.tokens and got.K == want.K
    assert check_only_verdict_reads(steps) == got.N - 1
    assert all(r.site.endswith("in verdict_to_host") for syncs in steps for r in syncs)


def test_the_sampled_verifier_judges_without_syncs_and_matches_the_target():
    """The device-side rejection sampler: no sync inside, and its outputs are distributed as P."""
    from kit import chisquare_pvalues, random_dist

    V, draws = 6, 3000
    p, q = random_dist(V, 3), random_dist(V, 4, zero_frac=0.4)
    verifier = Verifier(Sampling(1.0), 2, V, torch.arange(V), V, torch.device("cpu"))
    verifier.reset(0)
    drafts = torch.multinomial(q, draws, replacement=True, generator=torch.Generator().manual_seed(1))
    out, tokens = torch.zeros(2, dtype=torch.long), torch.zeros(draws, dtype=torch.long)
    with HostSyncCounter(device="cpu") as counter:
        for i in range(draws):
            verifier.remember(i, drafts[i : i + 1], q)
            tokens[i : i + 1].copy_(verifier.judge(i, p.log(), out)[1:])
    assert counter.total == 0, counter.summary()
    counts = torch.bincount(tokens, minlength=V)
    assert counts[p == 0].sum() == 0
    assert chisquare_pvalues(counts.numpy(), p.double().numpy())[0] > 1e-3


def test_every_message_travels_in_a_buffer_allocated_once(tiny_qwen35):
    """Per-step messages are sent from the send rings (the verdict from its host rows) and received into the
    same inboxes every step; a shorter prompt reuses the prefill buffers of a longer one."""
    from spd_lightning.geometry import Geometry

    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator = Simulator(tiny_qwen35, random_pdm(tiny_qwen35, geometry, num_layers=1), geometry, Sampling(1.0))
    runner, transport = simulator, simulator.transport
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


def test_the_verifier_runs_its_forward_before_it_takes_the_draft(tiny_qwen35, monkeypatch):
    """The verifier judges a draft only when the token before it leaves the last stage, so its forward of a
    step never waits for the draft that entered stage 1 in that step: it receives the draft after it."""
    from spd_lightning.geometry import Geometry

    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    simulator, want, log = recorded_run(tiny_qwen35, geometry, Sampling(1.0, top_k=20))
    verifier_rank = geometry.n - 1
    stage = Stage.from_target(tiny_qwen35, geometry, geometry.n)
    alone = OneRank(verifier_rank, log, True)
    runner = one_rank_runner(geometry, alone, {geometry.n: stage}, None, simulator.config)
    stage = runner.stages[geometry.n]
    events, recv, forward = [], alone.recv, stage.step

    def logged_recv(src, dst, tensor, kind):
        events.append(kind)
        recv(src, dst, tensor, kind)

    def logged_forward(*args, **kwargs):
        events.append("forward")
        return forward(*args, **kwargs)

    def logged_step(_step=runner.step):
        events.append("step")
        return _step()

    monkeypatch.setattr(alone, "recv", logged_recv)
    monkeypatch.setattr(stage, "step", logged_forward)
    monkeypatch.setattr(runner, "step", logged_step)
    got = decode_alone(runner, Sampling(1.0, top_k=20))
    assert (got.tokens, got.K) == (want.tokens, want.K)
    steps = [step.split() for step in " ".join(events).split("step")[1:]]
    both = [step for step in steps if "forward" in step and "draft_token" in step]
    assert both and all(step.index("forward") < step.index("draft_token") for step in both), steps


# -- batched decoding (B sequences per step): the same rule per step at B > 1 -----------------------------------
BATCH_PROMPTS = [PROMPT, [7, 7, 8], [5], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def batch_requests():
    """Greedy and sampled requests of mixed lengths, more than the slots: some join freed slots mid-run."""
    from inference.cycle.slots import Request

    settings = [Sampling(), Sampling(1.0, top_k=20), Sampling(), Sampling(0.8, top_p=0.9)]
    return [Request(p, 10 + 3 * i, sampling=s, seed=i) for i, (p, s) in enumerate(zip(BATCH_PROMPTS, settings))]


def batch_syncs_per_step(runner, counter: HostSyncCounter) -> list[list[HostSync]]:
    """Wrap `runner.step`: the syncs of each batched step (a join's prefill is not a step)."""
    steps, step = [], runner.step

    def counted():
        start = len(counter.records)
        try:
            return step()
        finally:
            steps.append([r for r in counter.records[start:] if is_sync(r)])

    runner.step = counted
    return steps


def check_batch_verdict_reads(steps: list[list[HostSync]]) -> None:
    """Only verdict reads: one `[B, 2]` read per step (two when a step ends a slot's decode and takes its own)."""
    others = [r for syncs in steps for r in syncs if not is_verdict_read(r)]
    assert not others, "\n".join(f"{r.kind} ({r.op}) at {r.site}" for r in others)
    assert all(len(syncs) <= 2 for syncs in steps) and sum(map(len, steps)) <= len(steps)


def recorded_batch_run(B: int):
    """A `Simulator` run of an often-accepted PDM (accepts and rejections, every fill level), its messages."""
    from kit import agreeing_pdm, nearly_bigram_target

    from inference.cycle.simulator import Simulator
    from spd_lightning.geometry import Geometry

    target = nearly_bigram_target("qwen3_5", 0.1)
    geometry = Geometry.build(target.num_layers, 3)
    simulator = Simulator(target, agreeing_pdm(target, geometry, 0.1), geometry, max_batch=B)
    transport = RecordingTransport(geometry.n + 1)
    simulator.transport = transport
    return target, geometry, simulator, simulator.run(batch_requests()), transport.log


@pytest.mark.parametrize("verdict_in_time", [True, False], ids=["verdict_early", "verdict_late"])
def test_every_batched_rank_syncs_only_to_read_the_verdict_once_per_step(monkeypatch, verdict_in_time):
    """B = 3 over a recorded `Simulator` run: each stage rank and the PDM rank alone (their own slot caches,
    per-slot positions and PDM offsets kept on the device) make no sync but the one read of each `[B, 2]`
    verdict, and decode what the recorded run decoded. A late verdict does not hold the PDM's draft up: it drafts
    for every slot not known to be wasted, discards the drafts of wasted ones, and sends exactly what the PDM of
    the recorded run sent."""
    from inference.cycle.pipeline import PipelineRunner
    from inference.runtime.drafter import PDMDrafter
    from inference.runtime.stages import Stage

    B = 3
    target, geometry, simulator, want, log = recorded_batch_run(B)
    assert sum(sum(r.counters["rejected_by_fill"]) for r in want) > 0
    assert sum(sum(r.counters["accepted_by_fill"]) for r in want) > 0
    for rank in range(geometry.n + 1):
        stages, drafter = {}, None
        if rank < geometry.n:
            stages = {rank + 1: Stage.from_target(target, geometry, rank + 1, B)}
        else:
            pdm = simulator.drafter.pdm
            drafter = PDMDrafter(pdm, geometry, target.embed_tokens, simulator.stages[1].dtype, B)
        alone = OneRank(rank, log, verdict_in_time)
        runner = PipelineRunner(geometry, alone, stages, drafter, simulator.config, B)
        forbid_device_sync(monkeypatch)
        with HostSyncCounter(device="cpu") as counter:
            steps = batch_syncs_per_step(runner, counter)
            got = runner.run(batch_requests())
        if rank == geometry.n - 1:  # the verifier's process knows every sequence's result
            assert [(r.tokens, r.K, r.counters) for r in got] == [(r.tokens, r.K, r.counters) for r in want]
        check_batch_verdict_reads(steps)
        if rank == geometry.n:
            recorded = [(dst, kind, t) for src, dst, kind, t in log if src == rank]
            assert [(d, k) for d, k, _ in alone.sent] == [(d, k) for d, k, _ in recorded]
            assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(alone.sent, recorded))
            assert (runner.discarded_drafts > 0) == (not verdict_in_time)


def test_the_batch_simulator_syncs_once_per_step(monkeypatch):
    """All ranks in one process at B = 3 and at B = 4 (no bucket padding): the verifier's one read of its
    `[B, 2]` verdict rows is the only sync per step."""
    for B in (3, 4):
        _, _, simulator, want, _ = recorded_batch_run(B)
        forbid_device_sync(monkeypatch)
        with HostSyncCounter(device="cpu") as counter:
            steps = batch_syncs_per_step(simulator, counter)
            got = simulator.run(batch_requests())
        assert [r.tokens for r in got] == [r.tokens for r in want]
        check_batch_verdict_reads(steps)
        assert all(r.site.endswith("in verdict_to_host") for syncs in steps for r in syncs)
