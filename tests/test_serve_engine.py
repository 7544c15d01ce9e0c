"""The server's queue and cancellation, over a slow fake decoder (in this process, uvicorn on a thread)."""

import json
import threading
import time

import httpx
import pytest
from kit import TINY_VOCAB, TOKEN_S, Letters, SlowBackend, make_tokenizer, served

from inference.backends import Cancelled
from inference.cycle.result import DecodeResult
from inference.serving.app import ServerConfig, build_app
from inference.serving.engine import Engine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(request):

    params = getattr(request, "param", {})
    backend = SlowBackend(params.get("chunk", 1))
    engine = Engine(lambda: backend, Letters(), "ar", queue_size=params.get("queue_size", 1))
    app = build_app(engine, ServerConfig("fake", 100, 10, 200))
    with served(app) as url:
        yield url, engine, backend


def _complete(url, prompt, max_tokens, results, stream=False):
    body = {"model": "fake", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    results[prompt] = httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def test_a_full_queue_is_a_429_and_the_queued_requests_complete(server):
    url, engine, _ = server
    results = {}
    running = threading.Thread(target=_complete, args=(url, "abc", 20, results))
    running.start()
    while engine.queue_depth < 1:
        time.sleep(0.01)
    waiting = threading.Thread(target=_complete, args=(url, "xy", 3, results))
    waiting.start()
    while engine.queue_depth < 2:
        time.sleep(0.01)
    refused = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "q", "max_tokens": 2})
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    running.join(30), waiting.join(30)
    assert results["abc"].json()["choices"][0]["text"] == "abc" * 6 + "ab"
    assert results["xy"].json()["choices"][0]["text"] == "xyx"


def test_a_client_that_disconnects_has_its_request_cancelled(server):
    url, engine, backend = server
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        timeout=30,
        json={"model": "fake", "prompt": "abc", "max_tokens": 100, "stream": True},
    ) as reply:
        first = next(reply.iter_lines())
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "a"
    deadline = time.monotonic() + 10
    while engine.metrics.requests.get("cancelled", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.metrics.requests.get("cancelled") == 1
    assert backend.generated[-1] < 100
    ok = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "ab", "max_tokens": 3}, timeout=30)
    assert ok.json()["choices"][0]["text"] == "aba"


def test_an_abandoned_non_streamed_request_is_cancelled_at_once(server):
    """The `openai` client gives up after 1 s and retries twice: each attempt is cancelled when its client
    goes, although a token arrives every TOKEN_S (none decodes its 100 tokens), and counts as cancelled."""
    import openai

    url, engine, backend = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=1.0, max_retries=2)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="fake", prompt="abc", max_tokens=100)
    deadline = time.monotonic() + 20
    while engine.metrics.requests.get("cancelled", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.metrics.requests.get("cancelled") == 3 and "ok" not in engine.metrics.requests
    assert len(backend.generated) == 3 and max(backend.generated) < 100
    assert engine.metrics.tokens == sum(backend.generated)  # cancelled requests' tokens are counted too


@pytest.mark.parametrize("server", [{"chunk": 3}], indirect=True)
def test_a_stop_ended_answer_counts_the_tokens_up_to_the_stop(server):
    """Three tokens per cycle: "abc", "abc"; the stop string "ca" is complete at the 4th token."""
    import openai

    url, engine, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=30, max_retries=0)
    reply = client.completions.create(model="fake", prompt="abc", max_tokens=30, stop="ca")
    assert reply.choices[0].text == "ab" and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 4
    assert engine.metrics.tokens == 6  # what the decoder verified, stopped request or not


def test_latency_histograms_in_metrics(server):
    url, _, _ = server
    httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "ab", "max_tokens": 5}, timeout=30)
    metrics = httpx.get(f"{url}/metrics").text
    for name in (
        "spd_time_to_first_token_seconds",
        "spd_time_to_first_token_with_queue_seconds",
        "spd_time_per_output_token_seconds",
    ):
        assert f"# TYPE {name} histogram" in metrics
        assert f'{name}_bucket{{mode="ar",le="+Inf"}}' in metrics
    assert 'spd_time_to_first_token_seconds_count{mode="ar"} 1' in metrics
    assert 'spd_time_per_output_token_seconds_count{mode="ar"} 4' in metrics  # 5 tokens: 4 gaps
    assert 'spd_generated_tokens_total{mode="ar"} 5' in metrics


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("get", "/nowhere", None, 404),
        ("get", "/v1/completions", None, 405),
        ("get", "/v1/models/other", None, 404),
        ("post", "/v1/completions", {"model": "fake", "prompt": "a" * 150, "max_tokens": 51}, 400),  # > 200
        ("post", "/v1/completions", {"model": "fake", "prompt": "ab", "seed": 2**64}, 400),
        ("post", "/v1/completions", {"model": "fake", "prompt": "ab", "seed": -(2**63) - 1}, 400),
        ("post", "/v1/completions", {"model": "fake", "prompt": "ab", "stop": ["a", "b", "c", "d", "e"]}, 400),
        ("post", "/v1/completions", {"model": "fake", "prompt": "ab", "stop": "x" * 257}, 400),
        ("post", "/v1/completions", {"model": "fake", "prompt": "a" * (1 << 20)}, 413),
        ("post", "/v1/completions", '{"model": "fake", "prompt": "ab", "temperature": Infinity}', 400),
        ("post", "/v1/completions", '{"model": "fake", "prompt": "a\\ud800"}', 400),
        ("post", "/v1/completions", '{"model": "fake", "prompt": "ab", "seed": 1' + "0" * 5000 + "}", 400),
        ("post", "/v1/completions", '{"model": "fake", "prompt": "ab", "x": [-' + "9" * 5000 + "]}", 400),
    ],
    ids=[
        "no-path",
        "wrong-method",
        "no-model",
        "past-context",
        "seed-high",
        "seed-low",
        "stops",
        "long-stop",
        "huge-body",
        "inf",
        "surrogate",
        "seed-of-5001-digits",  # over Python's int limit: json.loads raised a bare ValueError (a 500)
        "ignored-field-of-5000-digits",
    ],
)
def test_errors_have_the_openai_shape(server, method, path, body, status):
    url, engine, _ = server
    content = body if isinstance(body, str) or body is None else json.dumps(body)
    reply = httpx.request(method, f"{url}{path}", content=content, timeout=30)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert engine.metrics.requests == {}  # nothing reached the decoder


def test_an_error_quotes_at_most_a_hundred_characters_of_what_the_client_sent(server):
    """A 10,000-character model name (in a body or a path), a max_tokens of 4,000 digits, a 10,000-character key
    over a lone surrogate: each error quotes the value's start and an ellipsis, not the whole value; a normal
    value is quoted whole."""
    url, engine, _ = server
    long = "m" * 10_000
    replies = {
        "model": httpx.post(f"{url}/v1/completions", json={"model": long, "prompt": "ab"}, timeout=30),
        "path": httpx.get(f"{url}/v1/models/{long}", timeout=30),
        "max_tokens": httpx.post(
            f"{url}/v1/completions",
            content='{"model": "fake", "prompt": "ab", "max_tokens": ' + "9" * 4000 + "}",
            timeout=30,
        ),
        "key": httpx.post(
            f"{url}/v1/completions",
            content='{"model": "fake", "prompt": "ab", "x": {"' + long + '": "\\ud800"}}',
            timeout=30,
        ),
    }
    for name, reply in replies.items():
        error = reply.json()["error"]
        assert reply.status_code in (400, 404) and len(error["message"]) < 300, (name, len(error["message"]))
        assert len(error["param"] or "") <= 101 and "…" in error["message"], name
    assert (
        replies["model"].json()["error"]["message"] == f"model '{'m' * 100}…' does not exist: this server serves 'fake'"
    )
    short = httpx.post(f"{url}/v1/completions", json={"model": "other", "prompt": "ab"}, timeout=30)
    assert short.json()["error"]["message"] == "model 'other' does not exist: this server serves 'fake'"
    short = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": "ab", "max_tokens": 0}, timeout=30)
    assert short.json()["error"]["message"] == "max_tokens=0 must be in [1, 100]"
    newer = {"model": "fake", "prompt": "ab", "max_completion_tokens": 101}  # OpenAI's newer name: named as sent
    error = httpx.post(f"{url}/v1/completions", json=newer, timeout=30).json()["error"]
    assert (error["message"], error["param"]) == (
        "max_completion_tokens=101 must be in [1, 100]",
        "max_completion_tokens",
    )
    assert engine.metrics.requests == {}


def test_developer_role_and_content_parts_are_accepted(server):
    import openai

    url, _, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=30, max_retries=0)
    messages = [
        {"role": "developer", "content": "ab"},
        {"role": "user", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]},
    ]
    reply = client.chat.completions.create(model="fake", messages=messages, max_tokens=3)
    letters = Letters()  # no chat template: the contents joined by newlines, then cycled by SlowBackend
    assert reply.choices[0].message.content == letters.decode(letters("ab\ncd")["input_ids"][:3])
    assert client.models.retrieve("fake").id == "fake"


class Pipeline(SlowBackend):
    """A backend with the rank backend's lifecycle: not ready until told, dead once killed, and the reason it died."""

    def __init__(self):
        super().__init__()
        self.loaded, self.dead = threading.Event(), False
        self.failure: str | None = None

    def alive(self) -> bool:
        return not self.dead

    def ready(self) -> bool:
        return self.loaded.is_set()


def test_health_is_liveness_ready_follows_the_pipeline_and_an_idle_death_restarts_it(caplog):
    """An idle death is restarted with no request to notice it, and the log says why the pipeline died (nobody
    else hears of it: no request got its 503)."""

    started: list[Pipeline] = []

    def make_backend():
        started.append(Pipeline())
        return started[-1]

    engine = Engine(make_backend, Letters(), "ar", queue_size=1)
    app = build_app(engine, ServerConfig("fake", 100, 10, 200))
    try:
        with served(app) as url:
            assert httpx.get(f"{url}/health").status_code == 200  # the process is alive ...
            assert httpx.get(f"{url}/ready").status_code == 503  # ... but the ranks are still loading
            started[0].loaded.set()
            assert httpx.get(f"{url}/ready").status_code == 200
            started[0].failure = "rank 2 (PDM) failed: RuntimeError: boom; every rank was stopped"
            started[0].dead = True  # a rank dies while no request is in flight
            assert httpx.get(f"{url}/ready").status_code == 503
            deadline = time.monotonic() + 10
            while len(started) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(started) == 2 and engine.metrics.restarts == 1  # restarted with no request to notice it
            assert f"{started[0].failure}: starting a fresh pipeline" in caplog.text
            assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/ready").status_code == 503
            started[1].loaded.set()
            assert httpx.get(f"{url}/ready").status_code == 200
            reply = httpx.post(
                f"{url}/v1/completions", json={"model": "fake", "prompt": "ab", "max_tokens": 3}, timeout=30
            )
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "aba"
            assert started[1].generated == [3] and started[0].generated == []
    finally:
        engine.close()


def _load_test_module():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[1] / "scripts" / "load_test.py"
    spec = importlib.util.spec_from_file_location("load_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("server", [{"queue_size": 4}], indirect=True)
def test_the_load_test_drives_concurrent_openai_clients(server, capsys):
    url, engine, _ = server
    load_test = _load_test_module()
    port = url.rsplit(":", 1)[1]
    argv = ["--port", port, "--model", "fake", "--clients", "2", "--requests", "4", "--max-tokens", "3"]
    assert load_test.main([*argv, "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 requests (4 ok) from 2 clients" in out and "| 2 | 4 |" in out
    assert engine.metrics.requests == {"ok": 4} and engine.metrics.tokens == 12
    with pytest.raises(SystemExit):
        load_test.main(["--host", "10.1.2.3", "--model", "fake"])  # loopback only
    with pytest.raises(SystemExit):
        load_test.main(["--model", "fake", "--requests", "100000"])  # bounded


def test_a_pipeline_that_dies_before_it_is_ready_is_retried_ever_less_often():
    started: list[Pipeline] = []

    def make_backend():
        started.append(Pipeline())
        started[-1].dead = len(started) < 3  # the first two die while loading
        return started[-1]

    engine = Engine(make_backend, Letters(), "ar", queue_size=1)
    try:
        deadline = time.monotonic() + 20
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(started) == 3 and engine._restart_delay == 2.0  # 1 s after the first, 2 s after the second
        started[2].loaded.set()
        assert engine.ready
        started[2].dead = True  # it had served: restarted at once
        while len(started) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(started) == 4 and engine._restart_delay == 0.0
    finally:
        engine.close()


class OneSlotBackend:
    """Like the ranks: one slot, the requests beyond it wait inside the backend, and `cancel(hook)` is how the
    backend hears of a client gone: the only way for a request that has no slot yet (no token to refuse)."""

    def __init__(self):
        self.slot = threading.Lock()
        self.started: list[list[int]] = []  # the prompts that got the slot
        self.waiting = 0
        self.cancelled: list = []  # the hooks the engine forwarded a cancel for
        self._stops: dict = {}

    def generate(self, prompt_ids, max_new_tokens, sampling, seed, on_tokens):
        stop = self._stops.setdefault(on_tokens, threading.Event())
        self.waiting += 1
        while not self.slot.acquire(timeout=TOKEN_S):
            if stop.is_set():
                raise Cancelled
        self.waiting -= 1
        if stop.is_set():  # cancelled while it waited: it never starts
            self.slot.release()
            raise Cancelled
        self.started.append(list(prompt_ids))
        try:
            for _ in range(max_new_tokens):
                if stop.is_set():
                    raise Cancelled
                time.sleep(TOKEN_S)
                on_tokens([0])
        finally:
            self.slot.release()
        return DecodeResult(mode="ar", n=1, prompt_len=len(prompt_ids), tokens=[0] * max_new_tokens, K=max_new_tokens)

    def cancel(self, on_tokens) -> None:
        if on_tokens not in self.cancelled:  # the app may cancel twice (disconnect, then the stream's end)
            self.cancelled.append(on_tokens)
        self._stops.setdefault(on_tokens, threading.Event()).set()

    def close(self):
        pass


def test_a_cancel_reaches_the_backend_also_for_a_request_waiting_for_a_slot():
    """Two clients, one slot: the second waits inside the backend. When its client goes, the engine tells the
    backend at once (it never gets the slot); when the first client goes, the backend hears of it too, not
    just the engine's hook at the next token."""
    backend = OneSlotBackend()
    engine = Engine(lambda: backend, Letters(), "ar", queue_size=2, max_batch=2)
    body = {"model": "fake", "max_tokens": 200, "stream": True}
    with served(build_app(engine, ServerConfig("fake", 1000, 10, 2000))) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": "ab"}, timeout=30) as first:
            lines = first.iter_lines()  # kept: a dropped line iterator closes the response
            assert next(lines)
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": "cd"}, timeout=30):
                deadline = time.monotonic() + 10
                while backend.waiting < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert backend.waiting == 1
            deadline = time.monotonic() + 10
            while len(backend.cancelled) < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(backend.cancelled) == 1 and backend.started == [[0, 1]]
        while len(backend.cancelled) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(backend.cancelled) == 2
        while engine.metrics.requests.get("cancelled", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert engine.metrics.requests == {"cancelled": 2} and backend.started == [[0, 1]]


def test_a_conversation_the_chat_template_refuses_is_a_400_and_the_server_keeps_serving():
    """A template's `raise_exception` (Qwen3's "No user query found in messages.") raises jinja2's TemplateError,
    which is the client's conversation at fault: a 400 that quotes the template, never a 500."""
    tokenizer = make_tokenizer(TINY_VOCAB)
    refuse = "{% if messages[0].role != 'user' %}{{ raise_exception('Start with a user turn.') }}{% endif %}"
    tokenizer.chat_template = refuse + tokenizer.chat_template
    engine = Engine(lambda: SlowBackend(), tokenizer, "ar", queue_size=1)
    with served(build_app(engine, ServerConfig("fake", 100, 10, 200))) as url:

        def chat(*roles: str) -> httpx.Response:
            messages = [{"role": role, "content": "hello world"} for role in roles]
            body = {"model": "fake", "messages": messages, "max_tokens": 2}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)

        refused = chat("system", "user")
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["message"] == "the prompt cannot be tokenized: Start with a user turn."
        assert error["param"] == "messages"
        assert chat("user").status_code == 200


def test_a_model_name_with_a_slash_is_retrieved_by_its_name():
    """`--model-name Qwen/Qwen3-8B` (a hub id, as clients name models): `client.models.retrieve` asks for
    /v1/models/Qwen/Qwen3-8B, which the route's one path segment answered with a 404 for a model it lists."""
    import openai

    engine = Engine(lambda: SlowBackend(), Letters(), "ar", queue_size=1)
    with served(build_app(engine, ServerConfig("org/fake", 100, 10, 200))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=30, max_retries=0)
        assert client.models.retrieve("org/fake").id == "org/fake"
        assert httpx.get(f"{url}/v1/models/org%2Ffake").json()["id"] == "org/fake"
        assert httpx.get(f"{url}/v1/models/org/fake/", follow_redirects=True).json()["id"] == "org/fake"
        assert httpx.get(f"{url}/v1/models/", follow_redirects=True).json()["object"] == "list"
        other = httpx.get(f"{url}/v1/models/org/other")
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        assert client.completions.create(model="org/fake", prompt="ab", max_tokens=2).choices[0].text == "ab"


def test_a_client_gone_while_sending_its_body_is_a_499_not_an_error_with_a_traceback():
    """The disconnect comes while the body is read: starlette's `ClientDisconnect` escaped the handler, and
    uvicorn logged `Exception in ASGI application` with a traceback (and a 500) for an ordinary disconnect."""
    import asyncio

    app = build_app(Engine(lambda: SlowBackend(), Letters(), "ar", queue_size=1), ServerConfig("fake", 100, 10, 200))
    path = "/v1/completions"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    incoming = [{"type": "http.request", "body": b'{"model": ', "more_body": True}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499


def test_a_request_abandoned_while_queued_frees_its_place_at_once(server):
    """Its client gone, a queued request holds no place in the queue: the next client is queued, not a 429
    for as long as the decode ahead of it runs (an `openai` client that times out while queued retries)."""
    url, engine, _ = server  # queue_size 1
    results = {}
    running = threading.Thread(target=_complete, args=(url, "abc", 60, results))
    running.start()
    while engine.queue_depth < 1:
        time.sleep(0.01)
    body = {"model": "fake", "prompt": "xy", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as queued:
        assert queued.status_code == 200 and engine.queue_depth == 2
    deadline = time.monotonic() + 1  # the decode ahead runs 3 s
    while engine.queue_depth > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.queue_depth == 1 and running.is_alive()
    waiting = threading.Thread(target=_complete, args=(url, "q", 2, results))
    waiting.start()
    waiting.join(30), running.join(30)
    assert results["q"].status_code == 200 and results["q"].json()["choices"][0]["text"] == "qq"
    assert engine.metrics.requests == {"ok": 2, "cancelled": 1}
