"""The server's queue and cancellation, over a slow fake decoder (in this process, uvicorn on a thread)."""

import json
import socket
import threading
import time

import httpx
import pytest

from inference.cycle.result import DecodeResult
from inference.serving.app import ServerConfig, build_app
from inference.serving.engine import Engine

pytestmark = pytest.mark.timeout(60)
TOKEN_S = 0.05


class Letters:
    """Token i is the letter chr(97 + i % 26); a prompt is its letters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)

    def __call__(self, text):
        return {"input_ids": [ord(c) - 97 for c in text]}


class SlowBackend:
    """One token every TOKEN_S: the prompt's letters, cycled."""

    def __init__(self):
        self.generated: list[int] = []  # tokens made per request

    def generate(self, prompt_ids, max_new_tokens, sampling, seed, on_tokens):
        tokens = []
        self.generated.append(0)
        for i in range(max_new_tokens):
            time.sleep(TOKEN_S)
            tokens.append(prompt_ids[i % len(prompt_ids)])
            self.generated[-1] += 1
            on_tokens(tokens[-1:])
        return DecodeResult("ar", 1, len(prompt_ids), tokens, len(tokens), "max_new_tokens")

    def close(self):
        pass


@pytest.fixture
def server():
    import uvicorn

    backend = SlowBackend()
    engine = Engine(lambda: backend, Letters(), "ar", queue_size=1)
    app = build_app(engine, ServerConfig("fake", 100, 10, 0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", engine, backend
    uv.should_exit = True
    thread.join(10)


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
