"""Serving over several nodes, the parts that need no second node: the report channel from another node's
ranks to node 0 (`inference.processes.nodes`), the node options of `inference.serve`, the ranks' count check.
The servers on two nodes are in tests/test_two_nodes.py."""

import dataclasses
import queue
import threading
import time
from multiprocessing.connection import Client

import pytest
import torch
from kit import free_port

from inference.cli import UsageError
from inference.processes.job import DecodeJob
from inference.processes.launch import Failed, NodesMismatch, Started, Streamed, _check_world_size
from inference.processes.nodes import (
    Nodes,
    NodeZeroUnreachable,
    Refused,
    RemoteRequestChannel,
    ReportListener,
    ReportSender,
    agent_rendezvous,
    answer,
    join_pipeline,
)
from inference.processes.reports import Inbox
from inference.sampling import Sampling
from inference.serving import server as serve
from spd_lightning.geometry import Geometry

pytestmark = pytest.mark.timeout(60)


class LocalQueue(queue.Queue):
    """The launcher's queue as a rank sees it (`put`, `close`, `join_thread`)."""

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass


def nodes(node_rank: int, port: int) -> Nodes:
    return Nodes(2, node_rank, 1, "127.0.0.1", port - 1, port)


def test_another_nodes_reports_reach_node_0_in_order_and_its_start_and_failure_stay_local_too():
    port = free_port()
    received = LocalQueue()
    listener = ReportListener(nodes(0, port), received)
    try:
        local = LocalQueue()
        sender = ReportSender(nodes(1, port), local, local_kinds=(Started, Failed))
        sent = [Started(2, 123), Streamed(0, [5, 6]), Failed(2, "PeerError: x", "trace", 1, False)]
        for message in sent:
            sender.put(message)
        sender.close()
        assert [received.get(timeout=10) for _ in sent] == sent
        assert [local.get_nowait(), local.get_nowait()] == [sent[0], sent[2]] and local.empty()
    finally:
        listener.close()


def test_the_listener_refuses_a_wrong_key_and_keeps_listening():
    port = free_port()
    received = LocalQueue()
    listener = ReportListener(nodes(0, port), received)
    try:
        with pytest.raises(Exception):  # noqa: B017 - multiprocessing's AuthenticationError or a closed socket
            Client(("127.0.0.1", port), authkey=b"another run").send("intruder")
        time.sleep(0.1)
        sender = ReportSender(nodes(1, port), LocalQueue(), local_kinds=())
        sender.put(Streamed(0, [1]))
        assert received.get(timeout=10) == Streamed(0, [1])
        sender.close()
    finally:
        listener.close()


def test_another_node_joins_the_pipeline_after_the_one_it_ran_never_that_one_again():
    """The race that made a rejoining node read dead ranks' addresses: its ranks failed, node 0's listener
    (and store) of that pipeline are still up. The join waits them out and returns the next pipeline."""
    port = free_port()
    first = dataclasses.replace(nodes(0, port), pipeline="first", terms=(("max_batch", 4),))
    ran_first = dataclasses.replace(nodes(1, port), pipeline="first")
    listener = ReportListener(first, LocalQueue())
    try:  # this node's own place, node 0's pipeline and terms
        assert join_pipeline(nodes(1, port), timeout_s=10) == dataclasses.replace(ran_first, terms=first.terms)
        with pytest.raises(NodeZeroUnreachable, match="did not start a pipeline .* within --timeout 0.5 s"):
            join_pipeline(ran_first, timeout_s=0.5)
        joined = []
        asking = threading.Thread(target=lambda: joined.append(join_pipeline(ran_first, 20).pipeline))
        asking.start()
        time.sleep(0.5)
        assert not joined  # still node 0's first pipeline: no answer
    finally:
        listener.close()
    time.sleep(0.3)  # between pipelines: nothing listens
    listener = ReportListener(dataclasses.replace(first, pipeline="second"), LocalQueue())
    try:
        asking.join(20)
        assert joined == ["second"]
    finally:
        listener.close()
    store_prefix = agent_rendezvous(dataclasses.replace(nodes(1, port), pipeline="second"), 60)["run_id"]
    assert store_prefix == "spd-serve-second" != agent_rendezvous(first, 60)["run_id"]


def eventually(condition, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_verifier_on_another_node_sees_the_servers_cancels_and_reports_back():
    """Node 0's cancels reach a verifier on node 1 over its watch connection, those sent before it watched
    included, and it keeps them all: with several slots, a request cancelled before another may still be
    decoding. Its cancel report comes back into the server's `RequestChannel`."""
    import multiprocessing as mp

    from inference.serving.ranks import CancelReport, RequestChannel

    port = free_port()
    channel = RequestChannel(mp.get_context("spawn"))
    listener = ReportListener(nodes(0, port), LocalQueue(), channel)
    try:
        channel.cancel(2)  # two before node 1's verifier watches: both sent when it does
        channel.cancel(3)
        verifier = RemoteRequestChannel(nodes(1, port))
        assert eventually(lambda: verifier.cancelled(3)) and verifier.cancelled(2)
        assert not verifier.cancelled(4)
        channel.cancel(4)
        assert eventually(lambda: verifier.cancelled(4)) and verifier.cancelled(3) and verifier.cancelled(2)
        verifier.record(CancelReport(4, 10, 11))
        assert eventually(lambda: channel.last_cancel() == CancelReport(4, 10, 11))
    finally:
        listener.close()
        channel.close()
    assert channel._subscribers == []


def test_another_node_takes_node_0s_max_batch_unless_given_and_any_other_difference_is_one_line():
    """Each node builds its job from its own command line; the ranks' messages are shaped by these settings, so a
    difference would hang them or mix shapes: node 1 checks its job against node 0's terms before a rank starts."""
    from spd_lightning.errors import UserError

    def job(**changes) -> DecodeJob:
        return DecodeJob("t", Geometry.build(4, 2), [], 4, [], 10, 8, Sampling(), **changes)

    zero = job(max_batch=4).terms()
    other = job()
    other.agree(zero, adopt=("max_batch",))
    assert other.max_batch == 4
    with pytest.raises(UserError, match="this node's max_batch is 2, node 0's is 4: start every node with the same"):
        job(max_batch=2).agree(zero, adopt=())
    with pytest.raises(UserError, match="this node's dtype is 'bfloat16', node 0's is 'float32'"):
        job(dtype="bfloat16", max_batch=4).agree(zero, adopt=("max_batch",))
    with pytest.raises(UserError, match="this node's geometry is Geometry"):
        DecodeJob("t", Geometry.build(4, 4), [], 4, [], 10, 8, Sampling(), max_batch=4).agree(zero)
    job(max_batch=4).agree(zero)  # the same settings: nothing to say
    job(max_batch=4, dtype="fp32").agree(zero)  # another spelling of the same dtype


def test_a_node_that_refuses_node_0s_terms_tells_node_0_why(caplog):
    """Node 1 learns node 0's terms with the pipeline; on a difference it stops with one line. Node 0's ranks would
    wait for it until the process-group timeout with no word of the cause: node 1 tells node 0's listener, which
    logs the reason, and node 0's wait for the answers (`Inbox.await_nodes`) ends at once with it."""
    from spd_lightning.errors import UserError

    port = free_port()
    zero = DecodeJob("t", Geometry.build(4, 2), [], 4, [], 10, 8, Sampling(), max_batch=4)
    received = LocalQueue()
    listener = ReportListener(dataclasses.replace(nodes(0, port), pipeline="p1", terms=zero.terms()), received)
    other = DecodeJob("t", Geometry.build(4, 2), [], 4, [], 10, 8, Sampling(), dtype="bfloat16", nodes=nodes(1, port))
    reason = "this node's dtype is 'bfloat16', node 0's is 'float32'"
    try:
        with caplog.at_level("WARNING", logger="inference.processes.nodes"):
            with pytest.raises(UserError, match=reason):
                serve.join_next_pipeline(other, adopt=("max_batch",))
            refused = received.get(timeout=10)
        assert isinstance(refused, Refused) and refused.reason.startswith(reason)
        assert (refused.node_rank, refused.pipeline) == (1, "p1")
        assert f"node 1 will not join pipeline p1: {reason}" in caplog.text
    finally:
        listener.close()
    inbox = Inbox(LocalQueue(), None, None)
    inbox.put(refused)
    inbox.close()
    assert inbox.await_nodes(1, timeout_s=60) == f"node 1 did not join: {refused.reason}"  # at once


def test_node_0_starts_its_ranks_once_every_other_node_joined_and_ignores_answers_to_another_pipeline():
    """Node 0's ranks start only when every other node has answered its pipeline `Joined` (`Inbox.await_nodes`): a
    missing node is a line after --timeout; an answer meant for another of node 0's pipelines is not counted."""
    port = free_port()
    inbox = Inbox(LocalQueue(), None, None)
    listener = ReportListener(dataclasses.replace(nodes(0, port), nnodes=3, pipeline="p2"), inbox)
    try:
        assert inbox.await_nodes(2, timeout_s=0.3) == "2 other node(s) did not answer within --timeout 0.3 s"
        answer(dataclasses.replace(nodes(1, port), pipeline="p1"))  # the previous pipeline's: ignored
        answer(dataclasses.replace(nodes(1, port), pipeline="p2"))
        assert inbox.await_nodes(2, timeout_s=0.5) == "1 other node(s) did not answer within --timeout 0.5 s"
        waiting = threading.Thread(target=lambda: answer(dataclasses.replace(nodes(2, port), pipeline="p2")))
        waiting.start()
        assert inbox.await_nodes(2, timeout_s=30) is None
        waiting.join()
        assert inbox.joined == {1, 2} and inbox.refusals == []
    finally:
        listener.close()
        inbox.close()


def test_only_rank_0_on_node_0_reads_requests():
    with pytest.raises(RuntimeError, match="only rank 0, on node 0"):
        RemoteRequestChannel(nodes(1, free_port())).get(timeout=1)


def test_the_nodes_must_start_the_pipelines_number_of_ranks():
    job = DecodeJob("t", Geometry.build(2, 2), [], 4, [], 10, 8, Sampling(), pdm_placement="shared")
    _check_world_size(job, 2)
    with pytest.raises(NodesMismatch, match="need 2: make the nodes' --nproc-per-node add up to it"):
        _check_world_size(job, 3)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nnodes", "2"], "--nproc-per-node"),
        (["--nnodes", "2", "--nproc-per-node", "1", "--simulate"], "drop --simulate"),
        (["--nnodes", "2", "--node-rank", "2", "--nproc-per-node", "1"], "node rank < nnodes"),
        (["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "localhost"], r"resolves to \S+ \(loopback\)"),
    ],
    ids=["no-nproc", "simulate", "node-rank", "name-of-loopback"],
)
def test_bad_node_options_are_usage_errors(argv, message):
    with pytest.raises(UsageError, match=message):
        serve.check_node_args(serve.parse_args(["--ckpt", "d", *argv]))


def test_node_options_make_the_jobs_nodes():
    args = serve.parse_args(["--ckpt", "d", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3"])
    assert serve.nodes_of(args) == Nodes(2, 1, 3, "127.0.0.1", 29500, 29501)
    assert serve.nodes_of(serve.parse_args(["--ckpt", "d"])) is None


def test_closing_the_listener_while_another_node_is_mid_handshake_does_not_hang():
    """Another node connects (its ranks' reports, or `join_pipeline` between pipelines) just as node 0 stops, and
    its handshake completes after `close` began: `close` must return whatever that connection does. (It hung when
    it woke the accepting thread with a handshake of its own, which nobody answered once that thread had ended.)"""
    import socket
    from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

    port = free_port()
    listener = ReportListener(nodes(0, port), LocalQueue())
    peer = Connection(socket.create_connection(("127.0.0.1", port)).detach())
    assert peer.poll(10)  # node 0's challenge is in: the connection is accepted, its handshake pending
    closing = threading.Thread(target=listener.close, daemon=True)
    closing.start()
    time.sleep(0.3)
    answer_challenge(peer, nodes(1, port).authkey)  # the handshake completes after `close` began
    deliver_challenge(peer, nodes(1, port).authkey)
    closing.join(10)
    assert not closing.is_alive(), "ReportListener.close hung"
    peer.close()


def test_a_connection_that_never_speaks_does_not_stop_the_other_nodes_reports():
    """A peer that connects to the report port and says nothing (a probe, a half-dead host) holds only its own
    connection: the ranks' reports still get in."""
    import socket

    port = free_port()
    received = LocalQueue()
    listener = ReportListener(nodes(0, port), received)
    idle = socket.create_connection(("127.0.0.1", port))
    try:
        sender = ReportSender(nodes(1, port), LocalQueue(), local_kinds=())
        threading.Thread(target=sender.put, args=(Streamed(0, [7]),), daemon=True).start()
        assert received.get(timeout=10) == Streamed(0, [7])
        sender.close()
    finally:
        idle.close()
        listener.close()


@pytest.mark.parametrize("mode", ["ar", "eagle3"])
def test_one_process_modes_across_nodes_are_one_line(tmp_path, mode):
    """`serve --nnodes 2` with a mode that decodes in one process, also where the drafter (or `--ckpt none`) implies
    it: node 0 served alone in-process while node 1 failed ("add --simulate"); one line on every node instead."""
    from kit import make_tiny_model, save_target

    from spd_lightning.eagle3.export import Eagle3Spec, save_eagle3
    from spd_lightning.eagle3.model import Eagle3Config, Eagle3Drafter
    from spd_lightning.target import Target

    target = Target(make_tiny_model("qwen3", num_layers=2), "tiny")
    path = save_target(target.model, str(tmp_path / "target"))
    ckpt = "none"
    if mode == "eagle3":
        cfg = Eagle3Config(target.hidden_size, 32, (0, 1, 2), 4, 2, 8, 64)
        ckpt = save_eagle3(Eagle3Drafter(cfg, torch.arange(32)), Eagle3Spec(cfg, target.info), str(tmp_path / "d"))
    for node_rank in (0, 1):
        argv = ["--ckpt", ckpt, "--target", path, "--nnodes", "2", "--node-rank", str(node_rank)]
        args = serve.parse_args([*argv, "--nproc-per-node", "2", "--master-addr", "10.0.0.1"])
        with pytest.raises(UsageError, match=f"--mode {mode} decodes in one process: use --nnodes 1"):
            serve.prepared(args)
