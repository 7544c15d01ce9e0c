"""The server fuzzed from its own OpenAPI schema (schemathesis), and the hostile requests found by hand kept as
regression cases: no request gets a 5xx, a response the schema does not describe, or restarts the pipeline.

The fast run is short, seeded and bounded (under a minute: the boundary values of every field, a few random
examples) against the in-process decoder; the slow one runs every phase for up to ten minutes against rank processes with two slots.
"""

import http.client
import json
import os
import socket
import subprocess
import sys

import httpx
import pytest
from kit import SERVE_KEY, Server, started

pytestmark = pytest.mark.timeout(900)
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
CHECKS += ",response_headers_conformance"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(drafter_dir):
    args = ["--ckpt", drafter_dir, "--simulate", "--threads", "1", "--api-key", SERVE_KEY, "--max-tokens-cap", "2"]
    with started(Server(*args)) as (spd,):
        yield spd


def fuzz(server: Server, tmp_path, *options: str, timeout: float) -> None:
    """schemathesis' CLI against `server`; fails on any check it fails, then on any pipeline restart."""
    st = os.path.join(os.path.dirname(sys.executable), "st")
    command = [st, "run", f"{server.url}/openapi.json", "-H", f"Authorization: Bearer {SERVE_KEY}", "--checks", CHECKS]
    command += ["--seed", "1", "--workers", "1", "--request-timeout", "60", "--no-color", *options]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "passed" in run.stdout
    assert restarts(server) == 0 and httpx.get(f"{server.url}/ready").status_code == 200


def restarts(server: Server) -> int:
    metrics = httpx.get(f"{server.url}/metrics").text
    return sum(
        int(float(line.split()[-1])) for line in metrics.splitlines() if line.startswith("spd_pipeline_restarts")
    )


def test_a_short_seeded_fuzz_run_finds_no_5xx_no_schema_violation_and_no_restart(server, tmp_path):
    """Every operation but chat's (the same sampling fields as /v1/completions): the coverage phase (each
    field's boundaries: it sends top_p 5e-324, which NaN'd the old sampler) and a few random examples."""
    options = ["--phases", "coverage,fuzzing", "--max-examples", "10", "--exclude-path", "/v1/chat/completions"]
    fuzz(server, tmp_path, *options, timeout=120)


@pytest.mark.slow
def test_ten_minutes_of_fuzzing_the_ranks(drafter_dir, tmp_path):
    args = ["--ckpt", drafter_dir, "--api-key", SERVE_KEY, "--max-tokens-cap", "8", "--max-batch", "2"]
    with started(Server(*args)) as (ranks,):
        fuzz(ranks, tmp_path, "--max-time", "600", "--max-examples", "100000", timeout=800)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"model": "spd", "messages": HI, "max_tokens": 2, "temperature": 1e-50}, 200, None),
        ({"model": "spd", "messages": HI, "max_tokens": 2, "temperature": 1.0, "top_p": 1e-50}, 200, None),
        ({"model": "spd", "messages": HI, "max_tokens": 2, "temperature": 1e300, "top_k": 3}, 200, None),
        ('{"model": "spd", "messages": [{"role": "user", "content": "hi"}], "x": ' + deep(2000) + "}", 400, "nests"),
        ('{"model": "spd", "x": ' + deep(100_000) + "}", 400, "nests"),
        ({"model": "spd", "messages": HI, "seed": True}, 400, "seed"),
        ({"model": "spd", "messages": HI, "stream": "yes"}, 400, "stream"),
        (
            {"model": "spd", "messages": HI, "logprobs": True, "frequency_penalty": 0.5},
            400,
            "logprobs, frequency_penalty",
        ),
        ({"model": "spd", "messages": HI, "tools": [{"type": "function"}]}, 400, "tools"),
        ({"model": "spd", "messages": HI, "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"model": "spd", "messages": HI, "n": 2}, 400, "n"),
        (
            {"model": "spd", "messages": HI, "max_tokens": 2, "logprobs": False, "presence_penalty": 0, "n": 1},
            200,
            None,
        ),
        ("[1, 2]", 400, "JSON object"),
        ('{"model": "spd", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "Unicode"),
    ],
    ids=[
        "temperature-1e-50",
        "top-p-1e-50",
        "temperature-1e300",
        "2000-levels-in-an-ignored-field",
        "100000-levels",
        "seed-true",
        "stream-yes",
        "logprobs-and-a-penalty",
        "tools",
        "json-response-format",
        "n-2",
        "neutral-values-accepted",
        "not-an-object",
        "lone-surrogate",
    ],
)
def test_hostile_requests_get_their_answer_and_no_restart(server, body, status, needle):
    before = restarts(server)
    reply = server.post("/v1/chat/completions", body)
    assert reply.status_code == status, reply.text
    if needle is not None:
        error = reply.json()["error"]
        assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert restarts(server) == before


def test_the_body_size_is_capped_before_reading_it(server):
    """A body that declares a terabyte is refused from its headers: the server reads none of it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SERVE_KEY}\r\n"
        conn.sendall(f"{head}Content-Length: {1 << 40}\r\n\r\n{{".encode())
        reply = http.client.HTTPResponse(conn)
        reply.begin()
        assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "headers, status",
    [
        ([("Authorization", f"bearer {SERVE_KEY}")], 200),
        ([("Authorization", f"BEARER   {SERVE_KEY}")], 200),
        ([("Authorization", SERVE_KEY)], 401),
        ([("Authorization", f"Basic {SERVE_KEY}")], 401),
        ([("Authorization", f"Bearer {SERVE_KEY}"), ("Authorization", f"Bearer {SERVE_KEY}")], 400),
        ([], 401),
    ],
    ids=["lower-case-scheme", "upper-case-and-spaces", "no-scheme", "basic", "two-headers", "none"],
)
def test_bearer_per_rfc_6750(server, headers, status):
    body = json.dumps({"model": "spd", "prompt": "hi", "max_tokens": 1})
    reply = httpx.post(f"{server.url}/v1/completions", content=body, headers=httpx.Headers(headers), timeout=60)
    assert reply.status_code == status, reply.text
    if status == 401:
        assert reply.headers["WWW-Authenticate"].startswith("Bearer")
