"""`python -m inference.serve` with real clients (the `openai` package, httpx), all on 127.0.0.1.

Two server processes per module (SPD on the simulator, and `--mode ar`), started once; the same tiny
target and random drafter as the decoder's tests.
"""

import contextlib
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from kit import SERVE_KEY, Server, chat_reply, child_pids, descendant_pids, simulated_decode, started, still_alive

pytestmark = pytest.mark.timeout(180)
PROMPT = "hello world"


@pytest.fixture(scope="module")
def servers(drafter_dir):
    """SPD on the simulator and AR, started together (each takes seconds to import and load)."""
    spd = ["--simulate", "--api-key", SERVE_KEY, "--queue-size", "32", "--max-tokens-cap", "64"]
    ar = ["--mode", "ar", "--model-name", "spd", "--api-key", SERVE_KEY]
    with started(Server("--ckpt", drafter_dir, *spd), Server("--ckpt", drafter_dir, *ar)) as both:
        yield both


@pytest.fixture(scope="module")
def spd(servers):
    return servers[0]


@pytest.fixture(scope="module")
def ar(servers):
    return servers[1]


def test_openai_client_greedy_matches_decode_and_ar(drafter_dir, spd, ar, capsys):
    decoded = simulated_decode(drafter_dir, PROMPT, 12, capsys)
    whole, streamed = chat_reply(spd, PROMPT, 12, stream=False), chat_reply(spd, PROMPT, 12, stream=True)
    assert whole == streamed == decoded and decoded.strip()
    assert chat_reply(ar, PROMPT, 12, stream=False) == chat_reply(ar, PROMPT, 12, stream=True) == decoded
    completion = spd.client().completions.create(model="spd", prompt="the cat sat", temperature=0, max_tokens=8)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 8


def test_twenty_concurrent_clients_each_get_their_own_answer(spd):
    prompts = [f"w{i + 10} w{2 * i + 30} cat" for i in range(20)]
    expected = {p: chat_reply(spd, p, 8, stream=False) for p in prompts[:3]}  # sequential references
    answers: dict[str, str] = {}

    def ask(prompt: str, stream: bool) -> None:
        answers[prompt] = chat_reply(spd, prompt, 8, stream)

    threads = [threading.Thread(target=ask, args=(p, i % 2 == 0)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(answers) == sorted(prompts)
    for prompt, text in expected.items():
        assert answers[prompt] == text
    references = {p: chat_reply(spd, p, 8, stream=False) for p in prompts[3:]}
    assert all(answers[p] == references[p] for p in references)
    assert len(set(answers.values())) > 1  # different prompts, different answers: none mixed up


@pytest.mark.parametrize(
    "body, key, status, code",
    [
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, SERVE_KEY, 404, "model_not_found"),
        ({"model": "spd", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, SERVE_KEY, 400, None),
        ({"model": "spd", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 65}, SERVE_KEY, 400, None),
        (
            {"model": "spd", "messages": [{"role": "user", "content": "cat " * 600}]},
            SERVE_KEY,
            400,
            "context_length_exceeded",
        ),
        ('{"model": "spd", "messages": [', SERVE_KEY, 400, "invalid_json"),
        ({"model": "spd", "messages": []}, SERVE_KEY, 400, "invalid_request"),
        ({"model": "spd", "messages": [{"role": "user", "content": "hi"}]}, "wrong", 401, "invalid_api_key"),
        ({"model": "spd", "messages": [{"role": "user", "content": "hi"}]}, None, 401, "invalid_api_key"),
    ],
    ids=[
        "unknown-model",
        "max-tokens-0",
        "max-tokens-over-cap",
        "too-long",
        "malformed-json",
        "no-messages",
        "wrong-key",
        "missing-key",
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(spd, body, key, status, code):
    reply = spd.post("/v1/chat/completions", body, key)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    assert chat_reply(spd, PROMPT, 4, stream=False)


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1, 2**64 - 1])
def test_extreme_seeds_decode_and_repeat(spd, seed):
    """Every seed the API accepts is one the decoder takes (torch's 64-bit range), sampled or greedy."""
    client = spd.client()
    ask = dict(model="spd", prompt=PROMPT, max_tokens=6, seed=seed)
    sampled = [client.completions.create(**ask, temperature=1.0).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert client.completions.create(**ask, temperature=0).choices[0].text
    assert 'outcome="failed"' not in httpx.get(f"{spd.url}/metrics").text


def test_a_non_ascii_key_is_a_401_and_a_lone_surrogate_a_400(spd):
    url = f"{spd.url}/v1/completions"
    body = {"model": "spd", "prompt": "hi", "max_tokens": 2}
    reply = httpx.post(url, json=body, headers={"Authorization": "Bearer sk-t\u00e9st".encode("latin-1")})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    surrogate = '{"model": "spd", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    reply = spd.post("/v1/chat/completions", surrogate)
    assert reply.status_code == 400 and "messages.0.content" in reply.json()["error"]["message"]


def test_developer_role_and_content_parts_render_as_system_and_text(spd):
    """OpenAI's newer request shape renders exactly as the plain one: developer -> system, parts joined."""
    client = spd.client()
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    shaped = [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": [{"type": "text", "text": PROMPT}]},
    ]
    answers = [
        client.chat.completions.create(model="spd", messages=m, temperature=0, max_tokens=6) for m in (plain, shaped)
    ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens


def test_models_health_and_metrics(spd):
    assert (
        httpx.get(f"{spd.url}/v1/models", headers={"Authorization": f"Bearer {SERVE_KEY}"}).json()["data"][0]["id"]
        == "spd"
    )
    assert httpx.get(f"{spd.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{spd.url}/ready").status_code == 200
    assert spd.client().models.retrieve("spd").id == "spd"
    metrics = httpx.get(f"{spd.url}/metrics").text
    for name in (
        "spd_requests_total",
        "spd_generated_tokens_total",
        "spd_alpha",
        "spd_cycle_seconds",
        "spd_queue_depth",
        "spd_time_to_first_token_seconds_bucket",
        "spd_time_to_first_token_with_queue_seconds_bucket",
        "spd_time_per_output_token_seconds_bucket",
    ):
        assert name in metrics


def test_sigterm_stops_the_server_and_leaves_no_process(ar):
    server = ar  # the last test of the module: the server is done with
    assert server.post("/v1/completions", {"model": "spd", "prompt": "the cat", "max_tokens": 4}).status_code == 200
    children = child_pids(server.process.pid)
    assert server.stop() == 0  # a graceful stop exits 0 (uvicorn would re-raise the signal: 143)
    stderr = server.process.stderr.read()
    assert stderr.count("listening on http://127.0.0.1:") == 1
    assert all(line[:4].isdigit() and line[10] == "T" for line in stderr.splitlines() if line.strip()), stderr
    assert "Traceback" not in stderr
    assert not [p for p in children if os.path.exists(f"/proc/{p}")]


def test_ranks_serve_many_requests_and_a_killed_rank_is_a_503_then_a_restart(drafter_dir, capsys):
    """Persistent ranks (no --simulate): stage 2 kills itself at its 60th decode step (`faults.Fault`)."""
    decoded = simulated_decode(drafter_dir, PROMPT, 6, capsys)
    server = Server("--ckpt", drafter_dir, "--model-name", "spd", "--timeout", "30", fault="1:step:60:kill").ready()
    try:
        first = chat_reply(server, PROMPT, 6, stream=False)  # a few steps each: the fault's count is not reached
        listening = listening_addresses([server.process.pid, *descendant_pids(server.process.pid)])
        assert len(listening) >= 3 and {host for host, _ in listening} == {"127.0.0.1"}, listening  # stores too
        assert chat_reply(server, PROMPT, 6, stream=True) == first == decoded
        reply = server.post(
            "/v1/chat/completions",
            {"model": "spd", "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": PROMPT}]},
            key=None,
        )
        assert reply.status_code == 503
        assert "rank 1 (stage 2) was killed by signal 9" in reply.json()["error"]["message"]
        assert chat_reply(server, PROMPT, 6, stream=False) == first  # a fresh pipeline
        ranks = descendant_pids(server.process.pid)
        assert len(ranks) >= 3  # the fork server and the 3 ranks
        _kill_a_rank_while_idle(server)
        assert chat_reply(server, PROMPT, 6, stream=False) == first  # no 503: restarted before this request came
        ranks = descendant_pids(server.process.pid)
    finally:
        assert server.stop() in (0, -signal.SIGTERM)
    assert not still_alive(ranks, 15)


@pytest.mark.slow
def test_sigterm_finishes_a_long_stream_before_the_server_exits(drafter_dir):
    """Every decode step of stage 2 sleeps 30 ms (`faults.Fault` "slow"), so 300 tokens take well over the 5 s
    uvicorn used to wait: SIGTERM mid-stream still ends the stream with its finish chunk and [DONE]."""
    args = ["--ckpt", drafter_dir, "--model-name", "spd", "--max-tokens-cap", "300"]
    server = Server(*args, fault="1:step:1:slow").ready()
    try:
        _abandoned_requests_are_cancelled_in_the_ranks(server)
        body = {"model": "spd", "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            server.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    finally:
        assert server.stop() in (0, -signal.SIGTERM)


def listening_addresses(pids: list[int]) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket the processes `pids` listen on, read from /proc."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    address, port = fields[1].split(":")
                    found.append((_address(address), int(port, 16)))
    return found


def _address(hex_address: str) -> str:
    """/proc/net's little-endian hex words as an address: 0100007F -> 127.0.0.1, 32 zeros -> ::."""
    packed = b"".join(bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8))
    return socket.inet_ntop(socket.AF_INET if len(packed) == 4 else socket.AF_INET6, packed)


def _abandoned_requests_are_cancelled_in_the_ranks(server: Server) -> None:
    """The `openai` client gives up after 1 s and retries twice, non-streamed: the ranks stop each attempt
    (none decodes its 300 tokens), each counts as cancelled, and the next request is served at once."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=1.0, max_retries=2)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="spd", prompt=PROMPT, max_tokens=300, temperature=0)

    def metric(name: str) -> int:
        text = httpx.get(f"{server.url}/metrics").text
        return int(float(text.split(name, 1)[1].split("} ", 1)[1].split()[0])) if name in text else 0

    deadline = time.monotonic() + 60
    while metric('spd_requests_total{outcome="cancelled"') < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric('spd_requests_total{outcome="cancelled"') == 3
    assert metric("spd_generated_tokens_total{") < 3 * 300
    reply = server.client().completions.create(model="spd", prompt=PROMPT, max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4 and metric('spd_requests_total{outcome="ok"') == 1


def _kill_a_rank_while_idle(server: Server) -> None:
    """SIGKILL one rank (a child of the fork server, the server's child) with no request in flight: the
    server notices, restarts the pipeline on its own, and /ready says so; /health stays 200 throughout."""

    def restarts() -> int:
        text = httpx.get(f"{server.url}/metrics").text
        return int(float(text.split("spd_pipeline_restarts_total{", 1)[1].split("} ", 1)[1].split()[0]))

    before = restarts()
    rank = next(g for c in descendant_pids(server.process.pid) for g in descendant_pids(c))
    os.kill(rank, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while restarts() == before and time.monotonic() < deadline:
        assert httpx.get(f"{server.url}/health").status_code == 200
        time.sleep(0.1)
    assert restarts() == before + 1
    while httpx.get(f"{server.url}/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/ready").status_code == 200
