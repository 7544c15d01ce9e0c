"""Cancelling a request inside the pipeline (a served request that ends early): a STOP verdict ends the decode on
every rank at the same cycle, within the cycles until the next judged verdict, and the pipeline serves the next
request as if fresh. In the simulator (cycle-exact) and through the server's rank backend over gloo."""

import pytest
from kit import make_tiny_model, save_random_drafter, target_dir

from inference.cycle.ar import ar_decode
from inference.cycle.simulator import Simulator
from inference.runtime.replay import ReplayDrafter
from spd_lightning.geometry import Geometry

PROMPT, OTHER = [3, 14, 15, 92, 65, 35], [7, 7, 8]


class CancelAfter:
    """`on_tokens` + `stop` of a client that goes away once `tokens` tokens have arrived."""

    def __init__(self, tokens: int):
        self.tokens, self.received, self.cancelled = tokens, [], False

    def on_tokens(self, new):
        self.received += new
        self.cancelled = self.cancelled or len(self.received) >= self.tokens

    def stop(self) -> bool:
        return self.cancelled


@pytest.mark.parametrize("policy,bound", [("oracle", 0), ("adversary", 2), ("RRWRW", 2)])
def test_a_stop_ends_the_simulated_decode_at_the_next_verdict(tiny_qwen35, policy, bound):
    """n = 3: a verdict comes every cycle once the pipeline is full, and at most n - 1 cycles after a fill
    began (the first token's, or a rejection's refill); the runner then decodes the next prompt exactly as a
    fresh one."""
    geometry = Geometry.build(tiny_qwen35.num_layers, 3)
    references = [ar_decode(tiny_qwen35, p, 40).tokens for p in (PROMPT, OTHER, PROMPT)]
    fresh = Simulator(tiny_qwen35, ReplayDrafter(references[1:], policy, tiny_qwen35.vocab_size), geometry)
    simulator = Simulator(tiny_qwen35, ReplayDrafter(references, policy, tiny_qwen35.vocab_size), geometry)
    for at in (1, 2, 5):  # the first token (prefill), then mid-decode
        client = CancelAfter(at)
        result = simulator.decode(PROMPT, 40, on_tokens=client.on_tokens, stop=client.stop)
        assert result.stop_reason == "cancelled" and result.tokens == references[0][: result.N]
        seen = simulator.stop_seen
        assert 1 <= seen and result.K - seen <= (bound if at > 1 else geometry.n - 1) and result.N < 40
        simulator.drafter._next = 0  # replay the same references again
    simulator.drafter._next = 1
    for prompt in (OTHER, PROMPT):
        want, got = fresh.decode(prompt, 12), simulator.decode(prompt, 12)
        assert (got.tokens, got.K, got.counters, got.stop_reason) == (
            want.tokens,
            want.K,
            want.counters,
            want.stop_reason,
        )


@pytest.mark.timeout(240)
def test_the_rank_backend_cancels_inside_the_ranks_and_serves_on(tmp_path_factory, tmp_path):
    """The engine's `on_tokens` raises (the client is gone): the ranks stop within n - 1 cycles of reading the
    cancel, long before the request's end, and the next requests decode exactly as a fresh simulator does."""
    from inference.processes.job import DecodeJob
    from inference.sampling import Sampling
    from inference.serving.engine import Cancelled
    from inference.serving.ranks import RankBackend
    from spd_lightning.export import load_drafter

    path, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    geometry = Geometry.build(target.num_layers, 3)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    job = DecodeJob(
        path,
        geometry,
        [],
        400,
        [],
        target.vocab_size,
        target.hidden_size,
        Sampling(),
        drafter_path=drafter,
        timeout_s=60,
        stream=True,
    )
    backend = RankBackend(job)
    try:
        client = CancelAfter(3)

        def on_tokens(tokens):
            client.on_tokens(tokens)
            if client.cancelled:
                raise Cancelled

        with pytest.raises(Cancelled):
            backend.generate(PROMPT, 400, Sampling(), 0, on_tokens)
        report = backend.last_cancel
        assert report is not None and report.request_id == 0
        assert 1 <= report.seen_cycle <= report.stop_cycle <= report.seen_cycle + geometry.n - 1
        assert report.stop_cycle < 400  # a whole decode of 400 tokens takes more than 400 cycles
        tokens = []

        def quiet(new):  # a non-streamed request: its hook never raises; the app calls `cancel` instead
            tokens.extend(new)
            if len(tokens) >= 3:
                backend.cancel(quiet)

        with pytest.raises(Cancelled):
            backend.generate(PROMPT, 400, Sampling(), 0, quiet)
        report = backend.last_cancel
        assert report is not None and report.request_id == 1
        assert 1 <= report.seen_cycle <= report.stop_cycle <= report.seen_cycle + geometry.n - 1 < 400
        simulator = Simulator(target, load_drafter(drafter)[0], geometry)
        for prompt in (OTHER, PROMPT):
            late = lambda tokens: backend.cancel(quiet)  # noqa: E731 - a stale cancel: it must not reach this one
            got = backend.generate(prompt, 12, Sampling(), 0, late)
            want = simulator.decode(prompt, 12)
            assert (got.tokens, got.K, got.counters) == (want.tokens, want.K, want.counters)
            assert got.tokens == ar_decode(target, prompt, 12).tokens
    finally:
        backend.close()
