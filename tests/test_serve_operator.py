"""What an operator meets in the first hour, over the slow fake decoder of `test_serve_engine` (in this process):
an edge that never blocks, a stop that cuts with an error event, log lines that name the client's id, metrics
that describe themselves, cancels that reach the backend, and a port in use refused before any loading."""

import json
import logging
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from kit import REPO, TOKEN_S, Letters, SlowBackend, served

from inference.serving import logs
from inference.serving.app import ServerConfig, build_app
from inference.serving.engine import Engine
from inference.serving.intake import INTAKE_WORKERS
from inference.serving.metrics import Metrics
from inference.serving.shutdown import GracefulServer

pytestmark = pytest.mark.timeout(120)
MIB = 1 << 20


class GatedLetters(Letters):
    """A tokenizer that holds every call until the test opens `gate`, without the GIL (as a Rust tokenizer works):
    while calls are inside it, only a loop that never runs it can still answer."""

    def __init__(self):
        self.inside = threading.Semaphore(0)
        self.gate = threading.Event()

    def __call__(self, text):
        self.inside.release()
        self.gate.wait(60)
        return super().__call__(text)


def test_health_answers_while_every_intake_worker_tokenizes_a_one_mib_body():
    """Four bodies of 1 MiB: both intake workers are held inside the tokenizer (two bodies wait for a worker) and
    /health answers meanwhile; then all four complete. Run on the event loop, the first tokenization holds the
    loop, and the second never starts (no timing: the gate, not a clock, says when the tokenizer returns)."""
    letters = GatedLetters()
    engine = Engine(SlowBackend, letters, "ar", queue_size=8)
    app = build_app(engine, ServerConfig("fake", 4, 1, 1 << 22))  # a context of 4 Mi tokens: the body limit 256 MiB
    body = json.dumps({"model": "fake", "prompt": "abcd" * (MIB // 4), "max_tokens": 1}).encode()
    with served(app) as url:
        replies = []
        posts = [
            threading.Thread(
                target=lambda: replies.append(httpx.post(f"{url}/v1/completions", content=body, timeout=90))
            )
            for _ in range(4)
        ]
        for post in posts:
            post.start()
        try:
            assert all(letters.inside.acquire(timeout=30) for _ in range(INTAKE_WORKERS))
            with httpx.Client(timeout=10) as probe:
                assert [probe.get(f"{url}/health").status_code for _ in range(5)] == [200] * 5
        finally:
            letters.gate.set()
            for post in posts:
                post.join()
    assert [r.status_code for r in replies] == [200] * 4


def test_a_stop_that_runs_out_of_time_ends_each_stream_with_an_error_event():
    """SIGTERM's wait (here 0.3 s) runs out mid-stream: the stream ends with an SSE error event naming the stop
    and its wait (code `server_stopping`), the server closes, and the request counts as cancelled."""
    import uvicorn

    engine = Engine(SlowBackend, Letters(), "ar", queue_size=2)
    app = build_app(engine, ServerConfig("fake", 1000, 10, 2000))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=port), lambda: 0.3, engine.cut, "url")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    body = {"model": "fake", "prompt": "abc", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as reply:
        lines = (line for line in reply.iter_lines() if line.startswith("data: "))
        assert next(lines)
        server.should_exit = True
        rest = list(lines)
    thread.join(30)
    assert not thread.is_alive()
    error = json.loads(rest[-1].removeprefix("data: "))["error"]
    assert "the server is stopping and the 0.3 s it waits" in error["message"] and error["type"] == "server_error"
    assert error["code"] == "server_stopping"  # not the decoder's failure
    assert engine.metrics.requests == {"cancelled": 1}


def test_every_log_line_about_a_request_names_its_client_id():
    """The cancel line of a request whose client went away carries the `cmpl-` id the client was sent."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(logs.FORMAT))
    lines: list[str] = []
    handler.emit = lambda record: lines.append(handler.format(record))
    logs.configure_handler(handler)
    logger = logging.getLogger("inference")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        engine = Engine(SlowBackend, Letters(), "ar", queue_size=2)
        with served(build_app(engine, ServerConfig("fake", 1000, 10, 2000))) as url:
            body = {"model": "fake", "prompt": "abc", "max_tokens": 100, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
                first = json.loads(next(reply.iter_lines()).removeprefix("data: "))
            deadline = time.monotonic() + 10
            while not any("cancelled after" in line for line in lines) and time.monotonic() < deadline:
                time.sleep(TOKEN_S)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    cancel = next(line for line in lines if "cancelled after" in line)
    assert first["id"].startswith("cmpl-") and f" {first['id']} " in cancel
    assert cancel[:4].isdigit() and cancel[10] == "T"  # 2026-12-02T08:10:11.123Z ...


def test_every_metric_has_help_and_type_and_latency_buckets_reach_ten_minutes():
    metrics = Metrics()
    metrics.count("ok")
    text = metrics.render(0, "spd", True)
    names = {line.split("{")[0].split()[0] for line in text.splitlines() if not line.startswith("#")}
    for name in names:
        family = next(f for f in (name, name.rsplit("_", 1)[0]) if f"# TYPE {f} " in text)
        assert f"# HELP {family} " in text, family
    assert 'spd_time_to_first_token_with_queue_seconds_bucket{mode="spd",le="600.0"}' in text


def test_a_port_in_use_is_refused_before_the_weights_load(tmp_path):
    """Exit 2 with one line naming the port, before any setup (no --max-batch default is worked out)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "inference.serve", "--ckpt", str(tmp_path / "none"), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    assert run.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in run.stderr, run.stderr
    assert "does not exist" not in run.stderr  # refused before the drafter was even looked at
