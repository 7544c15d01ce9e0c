"""The server under test: `python -m inference.serve` as a child process (started, asked, stopped), an app served
in-process on a thread, the decode a served answer must equal, and a slow fake decoder with a letter tokenizer
behind the server's engine (tests/test_serve_engine.py, tests/test_serve_operator.py)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from inference.cycle.result import DecodeResult

from .runs import REPO, descendant_pids, free_port

SERVE_KEY = "sk-test"
TOKEN_S = 0.05


class Server:
    """`python -m inference.serve ARGS` on a free local port; `fault` is its SPD_FAULT, a fault the ranks inject
    (`inference.processes.faults.Fault`)."""

    def __init__(self, *args: str, fault: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": REPO}
        if fault is not None:
            env["SPD_FAULT"] = fault
        self.process = subprocess.Popen(
            [sys.executable, "-m", "inference.serve", "--port", str(self.port), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ready(self) -> "Server":
        import httpx

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stderr.read()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("the server did not come up in 90 s")

    def client(self, key: str = SERVE_KEY):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, timeout=60, max_retries=0)

    def post(self, path: str, body, key: str | None = SERVE_KEY, **kw):
        import httpx

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=60, **kw)

    def stop(self) -> int:
        """SIGTERM, then the exit status. 60 s guards against a hang, with room for a loaded machine; it is not a
        timing. A server that does not stop is killed with its ranks, so the failure is one line and leaves no process
        behind. With a 20 s wait that raised and left them running, the hang at exit that `reports.Inbox` now avoids
        looked like a slow machine."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            for pid in [*descendant_pids(self.process.pid), self.process.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(
                "the server did not stop within 60 s of SIGTERM; it and its ranks were killed"
            ) from None


@contextlib.contextmanager
def started(*servers: Server):
    """The servers once every one is ready (they load side by side: each takes seconds); all stopped after."""
    try:
        yield tuple(server.ready() for server in servers)
    finally:
        for server in servers:
            server.stop()


def chat_reply(server: Server, prompt: str, max_tokens: int, stream: bool, model: str = "spd") -> str:
    """A greedy chat completion's text, whole or assembled from its streamed chunks."""
    client = server.client()
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
        return reply.choices[0].message.content
    chunks = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=max_tokens, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks)


def simulated_decode(drafter: str, prompt: str, max_new_tokens: int, capsys) -> str:
    """The greedy answer `python -m inference.decode --simulate` prints for `prompt` (run in this process; `capsys`
    is the calling test's fixture): what the server must answer too."""
    from inference.decode import main as decode_main

    argv = ["--ckpt", drafter, "--prompt", prompt, "--max-new-tokens", str(max_new_tokens), "--simulate"]
    assert decode_main(argv) == 0
    return capsys.readouterr().out.split(f"### prompt 1: {prompt}\n", 1)[1].split("\n(N=", 1)[0]


@contextlib.contextmanager
def served(app):
    """`app` served by uvicorn on a free local port in a daemon thread; yields its base URL, stops it after."""
    import uvicorn

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10)


class Letters:
    """Token i is the letter chr(97 + i % 26); a prompt is its letters."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return "".join(chr(97 + i % 26) for i in ids)

    def __call__(self, text):
        return {"input_ids": [ord(c) - 97 for c in text]}


class SlowBackend:
    """`chunk` tokens every TOKEN_S: the prompt's letters, cycled."""

    def __init__(self, chunk: int = 1):
        self.chunk = chunk
        self.generated: list[int] = []  # tokens made per request

    def generate(self, prompt_ids, max_new_tokens, sampling, seed, on_tokens):
        tokens = []
        self.generated.append(0)
        while len(tokens) < max_new_tokens:
            time.sleep(TOKEN_S)
            new = [prompt_ids[i % len(prompt_ids)] for i in range(len(tokens), len(tokens) + self.chunk)]
            tokens += new
            self.generated[-1] += len(new)
            on_tokens(new)
        return DecodeResult(
            mode="ar", n=1, prompt_len=len(prompt_ids), tokens=tokens, K=len(tokens), stop_reason="max_new_tokens"
        )

    def close(self):
        pass
