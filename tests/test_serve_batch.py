"""`serve --max-batch B` (continuous batching) with real `openai` clients, all on 127.0.0.1.

In this process: the app and its engine over `BatchSimulatorBackend` (uvicorn on a thread), the tiny hybrid
target and a random drafter (n = 2). Each request's reference is its batch-1 decode, the `Simulator` that
`serve --simulate --max-batch 1` runs, with the request's sampling and seed. The tokenizer spells token i as
"i," so a text is its tokens. The schedule is read from the runner itself (its joins and ends, in the driver
thread), never from timings. The ranks: `serve --max-batch 3` as a child process, a stage killed with three
requests in flight.
"""

import contextlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from kit import REPO, Server, chat_reply, make_tiny_model, random_pdm, served, simulated_decode

from inference.cycle.simulator import Simulator
from inference.sampling import Sampling
from inference.serving.app import ServerConfig, build_app
from inference.serving.batch_backend import BatchSimulatorBackend
from inference.serving.engine import Engine
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target

pytestmark = pytest.mark.timeout(180)


class Numbers:
    """Token i is the text "i,"; a prompt is its numbers."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return "".join(f"{i}," for i in ids)

    def __call__(self, text):
        return {"input_ids": [int(w) for w in text.split()]}


def text(tokens) -> str:
    return "".join(f"{t}," for t in tokens)


@pytest.fixture(scope="module")
def models():
    target = Target(make_tiny_model("qwen3_5"), "tiny-qwen3_5")
    geometry = Geometry.build(target.num_layers, 2)
    return target, random_pdm(target, geometry), geometry


class GatedBackend(BatchSimulatorBackend):
    """Takes no request before `gate` is set: a test fills the FIFO first."""

    def __init__(self, *args):
        self.gate = threading.Event()
        super().__init__(*args)

    def _take(self, free, idle):
        self.gate.wait(60)
        return super()._take(free, idle)


class Schedule:
    """The runner's joins and ends, in order, from its own thread: ("join", prompt, steps so far) and
    ("end", prompt, steps so far) after the step that ended it."""

    def __init__(self, runner):
        self.events: list[tuple[str, tuple, int]] = []
        join, step = runner.join, runner.step

        def logged_join(request):
            self.events.append(("join", tuple(request.prompt_ids), runner.steps_run))
            return join(request)

        def logged_step():
            prompts = {b: seq.request.prompt_ids for b, seq in enumerate(runner.slots) if seq is not None}
            ended = step()
            self.events += [("end", tuple(prompts[b]), runner.steps_run) for b, _ in ended]
            return ended

        runner.join, runner.step = logged_join, logged_step

    def order(self, kind: str) -> list[tuple]:
        return [prompt for k, prompt, _ in self.events if k == kind]


@contextlib.contextmanager
def serving(models, max_batch: int, queue_size: int = 16, gated: bool = False):
    """(url, engine, backend, schedule) of an app over the batched simulator on a free port; `gated`: the
    backend takes no request before the test sets `backend.gate`."""

    target, pdm, geometry = models
    backends = []

    def make_backend():
        backends.append(GatedBackend(target, pdm, geometry, [], max_batch))
        return backends[-1]

    engine = Engine(make_backend, Numbers(), "spd", queue_size=queue_size, max_batch=max_batch)
    backend = backends[0]
    schedule = Schedule(backend.runner)
    if not gated:
        backend.gate.set()
    app = build_app(engine, ServerConfig("spd", 200, 16, 4096))
    try:
        with served(app) as url:
            try:
                yield url, engine, backend, schedule
            finally:
                backend.gate.set()  # before the server stops: a gated decode would hold its request open
    finally:
        engine.close()


def client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=240, max_retries=0)  # B = 1: 19 ahead


def complete(url: str, ask: dict, answers: dict, key) -> None:
    """One streamed completion; its text assembled from the chunks."""
    ask = dict(ask)
    extra = {"top_k": ask.pop("top_k")} if "top_k" in ask else None  # an extension of OpenAI's API
    chunks = client(url).completions.create(model="spd", stream=True, extra_body=extra, **ask)
    answers[key] = "".join(c.choices[0].text for c in chunks if c.choices)


def concurrently(url: str, asks: dict) -> dict:
    answers: dict = {}
    threads = [threading.Thread(target=complete, args=(url, ask, answers, key)) for key, ask in asks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return answers


def reference(models, prompt: str, max_tokens: int, temperature=0.0, top_k=0, top_p=1.0, seed=0) -> str:
    """The batch-1 decode (what `serve --simulate --max-batch 1` answers)."""
    target, pdm, geometry = models
    simulator = Simulator(target, pdm, geometry, Sampling(temperature, top_k, top_p))
    return text(simulator.decode(Numbers()(prompt)["input_ids"], max_tokens, None, seed).tokens)


MIXED = {
    "greedy-short": dict(prompt="5", max_tokens=9, temperature=0.0),
    "greedy-long": dict(prompt="3 14 15 92 65 35 8 9 7 9 3 2", max_tokens=14, temperature=0.0),
    "sampled": dict(prompt="7 7 8", max_tokens=12, temperature=1.0, seed=11),
    "top-k": dict(prompt="40 41", max_tokens=10, temperature=0.7, top_k=12, seed=3),
    "top-p": dict(prompt="11 12 13 14 15", max_tokens=8, temperature=1.2, top_p=0.9, seed=2**40),
    "greedy-mid": dict(prompt="20 21 22 23", max_tokens=11, temperature=0.0),
}


@pytest.mark.hf_internals
def test_concurrent_mixed_requests_each_equal_their_batch_one_decode(models):
    """Six concurrent requests at B = 4 (prompts of 1 to 12 tokens; greedy, temperature, top-k, top-p; seeds):
    each text is its batch-1 decode's (what B = 1 serves), whatever shares the pipeline, so a seeded sampled
    request is the same at B = 1 and B = 4. Some request joined while others were mid-decode."""
    with serving(models, 4) as (url, _, _, schedule):
        answers = concurrently(url, MIXED)
    for key, ask in MIXED.items():
        settings = {k: ask[k] for k in ("temperature", "top_k", "top_p", "seed") if k in ask}
        assert answers[key] == reference(models, ask["prompt"], ask["max_tokens"], **settings), key
    assert any(step > 0 for kind, _, step in schedule.events if kind == "join")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("B", [1, 4])
def test_twenty_clients_wait_for_a_slot_not_for_the_others_decodes(models, B):
    """20 requests in the FIFO before the first joins (the schedule then depends on nothing but the code). At
    B = 4 the first 4 join before any step, and each later one joins at the first step boundary at which a
    slot is free for it: when the k-th (from 0) joins, at least k - 3 requests have ended, and at the boundary
    before, fewer had. Its first token comes with its join (the join's prefill), so its time to first token is
    the queue for a slot plus one prefill. At B = 1 the k-th waits for k whole decodes."""
    asks = {i: dict(prompt=f"{i + 3} {2 * i + 5} 7", max_tokens=3 + i % 4, temperature=0.0) for i in range(20)}
    with serving(models, B, queue_size=20, gated=True) as (url, engine, backend, schedule):
        answers: dict = {}
        threads = [threading.Thread(target=complete, args=(url, a, answers, i)) for i, a in asks.items()]
        for t in threads:
            t.start()

        def queued() -> bool:  # at B = 1 the engine holds them (one worker); batched, the backend
            return engine.queue_depth == 20 and (B == 1 or len(backend._routes) == 20)

        deadline = time.monotonic() + 60
        while not queued() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert queued()
        backend.gate.set()
        for t in threads:
            t.join(240)
    joins = [(prompt, step) for kind, prompt, step in schedule.events if kind == "join"]
    ends = [step for kind, _, step in schedule.events if kind == "end"]
    assert len(joins) == len(ends) == 20
    for k, (_, step) in enumerate(joins):
        ended_by = sum(1 for end in ends if end <= step)
        if B == 1:
            assert ended_by == k  # every request before it decoded to its end first
        elif k < B:
            assert step == 0
        else:
            assert ended_by >= k - B + 1 > sum(1 for end in ends if end < step)
    for i, ask in asks.items():
        assert answers[i] == reference(models, ask["prompt"], ask["max_tokens"])


def test_a_cancelled_request_frees_its_slot_and_the_others_finish(models):
    """B = 2: a long request, one whose client disconnects after its first chunk, and one waiting for a slot.
    The cancel stops the second inside the pipeline; the third takes its slot while the first is still
    decoding; both finish with their batch-1 text."""
    long, waiting = dict(prompt="9 8 7", max_tokens=60, temperature=0), dict(prompt="4 4", max_tokens=6, temperature=0)
    with serving(models, 2) as (url, engine, _, schedule):
        answers: dict = {}
        first = threading.Thread(target=complete, args=(url, long, answers, "long"))
        first.start()
        wait_for(lambda: ("join", (9, 8, 7)) in [(kind, prompt) for kind, prompt, _ in schedule.events])
        body = {"model": "spd", "prompt": "6 5", "max_tokens": 60, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        complete(url, waiting, answers, "waiting")
        first.join(120)
        wait_for(lambda: engine.metrics.requests.get("cancelled") == 1)
    order = [(kind, prompt) for kind, prompt, _ in schedule.events]
    assert order.index(("end", (6, 5))) < order.index(("join", (4, 4))) < order.index(("end", (9, 8, 7)))
    assert answers == {"long": reference(models, "9 8 7", 60), "waiting": reference(models, "4 4", 6)}


def test_a_request_abandoned_while_it_waits_for_a_slot_frees_its_place_at_once(models):
    """B = 2, a queue of 1, the decoder held at its first boundary: two requests take the slots' places and a
    third waits for a slot. When its client goes, its place is free at once (a fourth client is queued, not
    a 429), and it never joins a slot: the other three answer their batch-1 text."""
    asks = {"a": dict(prompt="9 8 7", max_tokens=8), "b": dict(prompt="6 5", max_tokens=5)}
    with serving(models, 2, queue_size=1, gated=True) as (url, engine, backend, schedule):
        answers: dict = {}
        threads = [
            threading.Thread(target=complete, args=(url, {**a, "temperature": 0}, answers, k)) for k, a in asks.items()
        ]
        for t in threads:
            t.start()
        wait_for(lambda: engine.queue_depth == 2)
        body = {"model": "spd", "prompt": "4 4", "max_tokens": 6, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30):
            wait_for(lambda: len(backend._routes) == 3)  # handed to the backend, waiting for a slot
        wait_for(lambda: engine.queue_depth == 2, timeout=10)
        fourth = threading.Thread(
            target=complete, args=(url, dict(prompt="3 1", max_tokens=4, temperature=0), answers, "d")
        )
        fourth.start()
        wait_for(lambda: engine.queue_depth == 3)
        backend.gate.set()
        for t in [*threads, fourth]:
            t.join(120)
        wait_for(lambda: engine.metrics.requests.get("cancelled") == 1)
    assert (4, 4) not in schedule.order("join")
    assert answers == {
        "a": reference(models, "9 8 7", 8),
        "b": reference(models, "6 5", 5),
        "d": reference(models, "3 1", 4),
    }


def wait_for(condition, timeout: float = 60) -> None:
    """Until `condition()` holds (the test then asserts on a state it has seen, not on thread timing)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_max_batch_is_checked_and_defaults_to_one_on_the_cpu():
    import argparse

    from inference.cli import UsageError
    from inference.serving.batching import GPU_BATCH, batch_that_fits, check_max_batch, default_max_batch

    base = dict(max_batch=2, pdm_placement="separate", nnodes=1, compile=False, device="cpu")
    for changes, mode, message in (
        (dict(max_batch=0), "spd", "--max-batch 0 must be >= 1"),
        ({}, "ar", "--mode ar serves one request at a time"),
    ):
        with pytest.raises(UsageError, match=message):
            check_max_batch(argparse.Namespace(**{**base, **changes}), mode)
    for accepted in ({}, dict(pdm_placement="shared"), dict(compile=True), dict(nnodes=2)):  # one runner, any B
        check_max_batch(argparse.Namespace(**{**base, **accepted}), "spd")
    assert default_max_batch(argparse.Namespace(**base), setup=None) == 1  # the CPU: nothing loaded to ask
    gib = 1 << 30
    assert batch_that_fits(80 * gib, 2 * gib, 4 * gib) == GPU_BATCH
    assert batch_that_fits(24 * gib, 8 * gib, 2 * gib) == 4  # half of the 16 GiB the weights leave
    assert batch_that_fits(16 * gib, 15 * gib, 4 * gib) == 1  # never below one


def ready_within(server: Server, seconds: float) -> None:
    """/ready is 200 within `seconds` (the ranks load slowly on a busy machine: a pipeline starts twice here)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.process.stderr.read()
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.url}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise AssertionError(f"the server was not ready within {seconds} s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_ranks_serve_a_batch_and_a_rank_killed_with_three_in_flight_fails_each(drafter_dir, capsys):
    """`serve --max-batch 3` on 3 rank processes: two concurrent greedy chats answer as `decode` does; then
    stage 2 kills itself at its 40th decode step (`faults.Fault`) while three requests of 64 tokens decode
    together: each gets its own 503 naming the rank, and a fresh pipeline answers the next request."""
    prompts = ["hello world", "the cat sat on the mat"]
    expected = {p: simulated_decode(drafter_dir, p, 6, capsys) for p in prompts}
    args = ["--ckpt", drafter_dir, "--model-name", "spd", "--timeout", "30", "--max-batch", "3"]
    server = Server(*args, fault="1:step:40:kill")
    try:
        ready_within(server, 240)
        answers: dict = {}
        threads = [
            threading.Thread(target=lambda p=p, i=i: answers.__setitem__(p, chat_reply(server, p, 6, stream=i == 0)))
            for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert answers == expected
        replies: dict = {}

        def doomed(i: int) -> None:
            body = {"model": "spd", "prompt": f"w{i + 3} cat", "max_tokens": 64, "temperature": 0}
            replies[i] = server.post("/v1/completions", body, key=None)

        threads = [threading.Thread(target=doomed, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(r.status_code for r in replies.values()) == [503, 503, 503]
        for reply in replies.values():
            assert "rank 1 (stage 2) was killed by signal 9" in reply.json()["error"]["message"]
        assert chat_reply(server, prompts[0], 6, stream=False) == expected[prompts[0]]  # a fresh pipeline
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'spd_requests_total{outcome="failed"' in metrics and "spd_pipeline_restarts_total" in metrics
    finally:
        assert server.stop() in (0, -signal.SIGTERM)


QUEUED_FOR_DEAD_RANKS = """
import multiprocessing as mp
from inference.sampling import Sampling
from inference.serving.ranks import RequestChannel
from inference.serving.slot_feed import QueuedRequest

channel = RequestChannel(mp.get_context("fork"))
for i in range(8):  # the requests queued when the ranks died: 8 x 10k tokens, over the pipe's room
    channel.put(QueuedRequest(i, list(range(10_000)), 8, Sampling(), 0))
channel.close()
print("closed")
"""


def test_requests_queued_for_ranks_that_died_do_not_block_the_restart():
    """No rank reads the request queue once the ranks are gone: closing it (the engine's restart, the server's
    exit) drops what is queued instead of waiting forever for the pipe to drain."""
    done = subprocess.run(
        [sys.executable, "-c", QUEUED_FOR_DEAD_RANKS], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stdout.strip()) == (0, "closed"), done.stderr[-2000:]


def test_a_default_max_tokens_above_the_cap_is_one_line():
    """`serve --max-new-tokens` (a request's default max_tokens) above `--max-tokens-cap` was cut to the cap,
    silently; both are the operator's settings, so neither overrides the other quietly."""
    from inference.cli import UsageError
    from inference.serving import server

    with pytest.raises(UsageError, match="--max-new-tokens 2048 .* is above --max-tokens-cap 1024"):
        server.check_args(server.parse_args(["--ckpt", "d", "--max-new-tokens", "2048", "--max-tokens-cap", "1024"]))
    server.check_args(server.parse_args(["--ckpt", "d", "--max-new-tokens", "1024", "--max-tokens-cap", "1024"]))
    args = server.parse_args(["--ckpt", "d", "--max-tokens-cap", "64"])  # the default follows a lower cap
    server.check_args(args)
    assert args.max_new_tokens == 64
    args = server.parse_args(["--ckpt", "d"])
    server.check_args(args)
    assert args.max_new_tokens == server.DEFAULT_MAX_TOKENS == 256


def test_serve_has_no_seed_flag_each_request_brings_its_own(capsys):
    """`serve --seed` was accepted and never used (an unseeded request draws a random seed); argparse refuses it."""
    from inference.serving import server

    with pytest.raises(SystemExit) as exit_info:
        server.parse_args(["--ckpt", "d", "--seed", "42"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --seed 42" in capsys.readouterr().err
