"""The distributed decoder and the server on two nodes: two agents over a rendezvous on 127.0.0.1."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
from kit import (
    REPO,
    Server,
    chat_reply,
    descendant_pids,
    free_port,
    simulated_decode,
    still_alive,
)

from inference.decode import main as decode_main

pytestmark = pytest.mark.timeout(150)
PROMPT = "hello world"


def test_stages_split_across_two_nodes_decode_what_one_process_does(drafter_dir, capsys):
    args = ["--ckpt", drafter_dir, "--prompt", PROMPT, "--max-new-tokens", "10"]
    assert decode_main([*args, "--simulate"]) == 0
    expected = capsys.readouterr().out.split("\n(N=")[0]
    port = free_port()
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    env = {**os.environ, "PYTHONPATH": REPO}
    agents = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(procs),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "two-nodes",
                "-m",
                "inference.decode",
                *args,
                "--timeout",
                "60",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for procs in (2, 1)  # the n = 2 drafter's 3 ranks: 2 on one node, 1 on the other
    ]
    outputs = [agent.communicate(timeout=120) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], [err[-2000:] for _, err in outputs]
    printed = "".join(out for out, _ in outputs)
    assert printed.count("### prompt 1") == 1 and expected in printed


# Slow: test_stages_split_across_two_nodes_decode_what_one_process_does (two nodes, reports across them) and
# test_serve.py's test_ranks_serve_many_requests_and_a_killed_rank_is_a_503_then_a_restart (one node) stay fast.
@pytest.mark.slow
def test_the_server_on_two_nodes_answers_as_decode_restarts_after_a_killed_rank_and_stops_on_sigterm(
    drafter_dir, capsys
):
    """Node 0 serves HTTP and runs rank 0 (stage 1); node 1 runs ranks 1 (stage 2, the verifier) and 2 (the
    PDM), so every token reaches the server through node 1's report connections. Node 1's PDM kills itself
    at its 60th decode step (`faults.Fault`): the request in flight gets a 503 naming it, both nodes start
    a fresh pipeline, and the next request is answered. A stop string then cancels a request: node 1's
    verifier learns of it from node 0 and stops the ranks. SIGTERM to node 0 then ends both nodes."""
    decoded = simulated_decode(drafter_dir, PROMPT, 8, capsys)
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    nodes += ["--report-port", str(free_port()), "--timeout", "60", "--ckpt", drafter_dir]
    server = Server(*nodes, "--node-rank", "0", "--nproc-per-node", "1", "--model-name", "spd")
    worker = subprocess.Popen(
        [sys.executable, "-m", "inference.serve", *nodes, "--node-rank", "1", "--nproc-per-node", "2"],
        env={**os.environ, "PYTHONPATH": REPO, "SPD_FAULT": "2:step:60:kill"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        server.ready()
        assert chat_reply(server, PROMPT, 8, stream=False) == chat_reply(server, PROMPT, 8, stream=True) == decoded
        long = {"model": "spd", "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": PROMPT}]}
        reply = server.post("/v1/chat/completions", long, key=None)
        assert reply.status_code == 503 and "rank 2 (PDM)" in reply.json()["error"]["message"], reply.text
        assert chat_reply(server, PROMPT, 8, stream=True) == decoded  # a fresh pipeline on both nodes
        stop = decoded.split()[3]  # a stop string: the server cancels the request, the verifier on node 1 stops
        reply = server.post("/v1/chat/completions", {**long, "stop": [stop]}, key=None)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == decoded.split(stop)[0]
        ranks = descendant_pids(server.process.pid) + descendant_pids(worker.pid)
        assert server.stop() in (0, -signal.SIGTERM)
        assert worker.wait(30) == 0, worker.stderr.read()[-2000:]
        assert "cycle(s) after the ranks saw it" in server.process.stderr.read()  # stopped on node 1, reported
    finally:
        for process in (server.process, worker):
            if process.poll() is None:
                process.kill()
    assert len(ranks) >= 3 and not still_alive(ranks, 15)


@pytest.mark.slow
def test_two_nodes_serve_two_requests_at_once_and_cancel_each_on_the_other_nodes_verifier(drafter_dir, capsys):
    """`--max-batch 2` on node 0; node 1 is not told and takes node 0's (a node with B = 1 would exchange other
    shapes and hang). Two requests decode side by side, each answering what decode prints for it alone; then two
    requests are cancelled by their stop strings while both are in flight, each stopped by node 1's verifier."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [PROMPT, "the pipeline"]
    decoded = [simulated_decode(drafter_dir, p, 8, capsys) for p in prompts]
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    nodes += ["--report-port", str(free_port()), "--timeout", "60", "--ckpt", drafter_dir]
    server = Server(*nodes, "--node-rank", "0", "--nproc-per-node", "1", "--model-name", "spd", "--max-batch", "2")
    worker = subprocess.Popen(
        [sys.executable, "-m", "inference.serve", *nodes, "--node-rank", "1", "--nproc-per-node", "2"],
        env={**os.environ, "PYTHONPATH": REPO},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def stopped_at(i: int) -> str:
        stop = decoded[i].split()[2]
        body = {"model": "spd", "max_tokens": 40, "temperature": 0, "stop": [stop]}
        reply = server.post("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompts[i]}]})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"], decoded[i].split(stop)[0]

    try:
        server.ready()
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda p: chat_reply(server, p, 8, stream=True), prompts)) == decoded
            for got, expected in pool.map(stopped_at, range(2)):
                assert got == expected
        assert server.stop() in (0, -signal.SIGTERM)
        assert worker.wait(30) == 0, worker.stderr.read()[-2000:]
        assert server.process.stderr.read().count("cycle(s) after the ranks saw it") == 2  # both, on node 1
    finally:
        for process in (server.process, worker):
            if process.poll() is None:
                process.kill()


@pytest.mark.slow
def test_a_node_started_with_another_dtype_stops_with_one_line_and_node_0_logs_why(drafter_dir):
    """Node 1 started with --dtype bfloat16 beside node 0's float32 would exchange other dtypes with it. It stops
    with one line (exit 2) as soon as it learns node 0's terms, and tells node 0, which logs why and ends that
    pipeline with the reason at once: its ranks never start to wait for node 1's until --timeout (60 s here, beyond
    the 40 s this test waits for the line)."""
    import threading
    import time

    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    nodes += ["--report-port", str(free_port()), "--timeout", "60", "--ckpt", drafter_dir]
    server = Server(*nodes, "--node-rank", "0", "--nproc-per-node", "1", "--model-name", "spd")
    logged: list[str] = []
    threading.Thread(target=lambda: logged.extend(server.process.stderr), daemon=True).start()
    reason = "this node's dtype is 'bfloat16', node 0's is 'float32'"
    try:
        worker = subprocess.run(
            [sys.executable, "-m", "inference.serve", *nodes, "--node-rank", "1", "--nproc-per-node", "2"]
            + ["--dtype", "bfloat16"],
            env={**os.environ, "PYTHONPATH": REPO},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert worker.returncode == 2 and reason in worker.stderr and "Traceback" not in worker.stderr, worker.stderr
        deadline = time.monotonic() + 40
        while not any(f"node 1 did not join: {reason}" in line for line in logged) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = "".join(logged)
        assert "node 1 will not join pipeline" in text and f"node 1 did not join: {reason}" in text, worker.stderr
    finally:
        server.stop()
