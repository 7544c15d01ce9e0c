"""The distributed decoder's ranks over several nodes, for the server (`python -m inference.serve --nnodes 2`);
docs/SERVING.md, "Two nodes" says how the nodes meet, report, cancel and rejoin.

Each node runs one elastic agent (what `torchrun` runs) for its share of the ranks, in a static rendezvous
(`agent_rendezvous`): node `R`'s ranks follow node `R - 1`'s in rank order, so rank 0, the one that reads the
requests, is on node 0, beside the HTTP server. The ranks of node 0 report to the launcher through its local
queue (`reports.Inbox`); the ranks of the other nodes send the same reports (`ReportSender`) to node 0's
`ReportListener`, which puts them into that inbox: to the launcher of node 0 every rank reports alike, wherever
it runs. A verifier rank on another node learns of cancels over a connection of its own to that listener
(`RemoteRequestChannel.cancelled`). The connections' key carries no secret: it only keeps two runs on one
network from mixing. Every pipeline node 0 starts has a name of its own (`Nodes.pipeline`) that the
rendezvous's store keys carry; another node asks node 0's listener for the pipeline after the one it ran last
(`join_pipeline`): the listener of that same pipeline does not answer, the next one does. With the name come
the settings every rank must share (`Nodes.terms`), which the other nodes check theirs against
(`DecodeJob.agree`) and answer (`answer`): node 0 starts its ranks once every other node joined, and a node that
differs says why, which node 0 logs and ends that pipeline with at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener, answer_challenge, deliver_challenge
from typing import Any

from spd_lightning.errors import UserError

log = logging.getLogger(__name__)
# The cancels a verifier on another node keeps: request ids only grow, so the oldest of so many have long ended.
CANCELS_KEPT = 1024


@dataclass(frozen=True)
class Nodes:
    """This node's place in a multi-node run, identical on every node but for `node_rank` and `nproc`."""

    nnodes: int
    node_rank: int
    nproc: int  # the ranks this node runs
    master_addr: str
    master_port: int
    report_port: int
    run_id: str = "spd-serve"
    pipeline: str = ""  # the pipeline's name: node 0 picks it, the others get it from `join_pipeline`
    terms: tuple[tuple[str, Any], ...] = ()  # node 0's settings every rank shares (`DecodeJob.terms`), sent with it

    @property
    def report_address(self) -> tuple[str, int]:
        return self.master_addr, self.report_port

    @property
    def authkey(self) -> bytes:
        return self.run_id.encode()

    def connect(self):
        """A connection to node 0's `ReportListener`."""
        return Client(self.report_address, authkey=self.authkey)


@dataclass(frozen=True)
class WatchCancels:
    """A verifier rank on another node asks node 0's listener for the ids of the requests cancelled: the
    connection then carries each id (an int) one way, and the verifier's `CancelReport`s the other."""


class RemoteRequestChannel:
    """The server's request channel (`serving.ranks.RequestChannel`, on node 0) as the ranks of the other nodes
    see it: only rank 0, on node 0, reads its queue. The verifier's rank, wherever it runs, stops a cancelled
    request: here it learns of cancels over a connection of its own to node 0's listener, opened at its first
    poll (node 0 then sends its recent cancels, so none is missed), and sends back its report of each cancelled
    decode. It keeps every cancel it got (the last `CANCELS_KEPT`): with several slots, a request cancelled
    after another may still be decoding when the next cancel comes."""

    def __init__(self, nodes: Nodes):
        self.nodes = nodes
        self._connection = None  # opened in the rank's process
        self._cancels: dict[int, None] = {}  # an ordered set, oldest first

    def get(self, timeout: float | None = None):
        raise RuntimeError("this rank is not on node 0: only rank 0, on node 0, reads the requests")

    def cancelled(self, request_id: int) -> bool:
        """What the verifier polls once per cycle: the cancels node 0 has sent so far, without waiting."""
        if self._connection is None:
            self._connection = self.nodes.connect()
            self._connection.send(WatchCancels())
        while self._connection.poll(0):
            self._cancels[self._connection.recv()] = None
            if len(self._cancels) > CANCELS_KEPT:
                del self._cancels[next(iter(self._cancels))]
        return request_id in self._cancels

    def record(self, report) -> None:
        """The verifier's `CancelReport`, for node 0's `RequestChannel.last_cancel`."""
        if self._connection is not None:
            self._connection.send(report)


class ReportSender:
    """A rank's reports to node 0's `ReportListener`, in the interface of the local queue (`put`, `close`,
    `join_thread`); it connects at the first report, in the rank's process. The reports of the kinds
    `local_kinds` (its start, its failure) also go to this node's own launcher, which then knows which of
    its ranks failed and why."""

    def __init__(self, nodes: Nodes, local, local_kinds: tuple[type, ...]):
        self.nodes, self.local, self.local_kinds = nodes, local, local_kinds
        self._connection = None

    def put(self, message) -> None:
        if isinstance(message, self.local_kinds):
            self.local.put(message)
        if self._connection is None:
            self._connection = self.nodes.connect()
        self._connection.send(message)  # returns once written: nothing is left to flush

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
        self.local.close()

    def join_thread(self) -> None:
        self.local.join_thread()


class ReportListener:
    """On node 0: accepts the other nodes' ranks and puts every report they send into `messages` (the launcher's
    `Inbox`); sends the cancels of the server's `request_channel` to the verifier ranks that watch for them. It
    binds when built, before any rank starts; `close` stops accepting (connections already made end with their
    rank)."""

    def __init__(self, nodes: Nodes, messages, request_channel=None):
        self.nodes, self.messages, self.channel = nodes, messages, request_channel
        self._listener = Listener(nodes.report_address, backlog=16)  # authenticated per connection (`_forward`)
        self._closed = False
        self._watchers: list = []
        self._lock = threading.Lock()
        if request_channel is not None:
            request_channel.subscribe(self.cancel)
        threading.Thread(target=self._accept, name="spd-report-listener", daemon=True).start()

    def cancel(self, request_id: int) -> None:
        with self._lock:
            for connection in list(self._watchers):
                try:
                    connection.send(request_id)
                except OSError:  # its rank is gone
                    self._watchers.remove(connection)

    def _accept(self) -> None:
        while True:
            try:
                connection = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            if self._closed:
                connection.close()
                return
            threading.Thread(target=self._forward, args=(connection,), name="spd-report-in", daemon=True).start()

    def _forward(self, connection) -> None:
        with connection:
            # The handshake runs here, not in `accept`: a peer that connects and says nothing holds only this thread.
            try:
                deliver_challenge(connection, self.nodes.authkey)
                answer_challenge(connection, self.nodes.authkey)
            except AuthenticationError as e:  # e.g. another run's key: refuse this one, keep listening
                log.warning("refused a report connection: %s", e)
                return
            except (EOFError, OSError):  # a peer gone mid-handshake, or `close` waking the accepting thread
                return
            while True:
                try:
                    message = connection.recv()
                except (EOFError, OSError):
                    return
                if isinstance(message, PipelineQuery):
                    if message.previous != self.nodes.pipeline:
                        connection.send(self.nodes)
                    return
                if isinstance(message, WatchCancels):
                    return self._watch(connection)
                if isinstance(message, Joined | Refused) and message.pipeline != self.nodes.pipeline:
                    return  # an answer to another pipeline of node 0's
                if isinstance(message, Refused):
                    log.warning(
                        "node %d will not join pipeline %s: %s", message.node_rank, message.pipeline, message.reason
                    )
                self.messages.put(message)

    def _watch(self, connection) -> None:
        """A verifier's connection: cancels go out (`cancel`), its cancel reports come in, until its rank ends."""
        with self._lock:
            self._watchers.append(connection)
            for request_id in self.channel.recent_cancels() if self.channel is not None else ():
                connection.send(request_id)
        while True:
            try:
                report = connection.recv()
            except (EOFError, OSError):
                break
            if self.channel is not None:
                self.channel.record(report)
        with self._lock:
            if connection in self._watchers:
                self._watchers.remove(connection)

    def close(self) -> None:
        self._closed = True
        if self.channel is not None:
            self.channel.unsubscribe(self.cancel)
        # Wake the accepting thread, which then sees `_closed`, with a bare connection that waits for nothing: an
        # authenticated `Client` would wait forever for its handshake when that thread has just ended with another
        # node's connection (which hung the server's exit while node 1 asked for the next pipeline).
        with contextlib.suppress(OSError), socket.create_connection(self.nodes.report_address, timeout=1):
            pass
        self._listener.close()


@dataclass(frozen=True)
class PipelineQuery:
    """Another node's question to node 0's listener: the pipeline to join, which is not `previous`."""

    previous: str


@dataclass(frozen=True)
class Joined:
    """Another node's answer to a pipeline whose terms it shares: its agent starts now. Node 0 starts its own once
    every other node has joined (`reports.Inbox.await_nodes`), so a refusal ends the pipeline at once."""

    node_rank: int
    pipeline: str


@dataclass(frozen=True)
class Refused:
    """Another node's answer to a pipeline whose terms differ from its own (`DecodeJob.agree`): it will not join."""

    node_rank: int
    pipeline: str
    reason: str


class NodeZeroUnreachable(UserError):
    pass


def answer(nodes: Nodes, reason: str | None = None) -> None:
    """Tell node 0 whether this node joins its pipeline `nodes.pipeline` (`Joined`), or why not (`Refused`): node 0
    waits for every answer before its own ranks start. Best effort: node 0 may be gone (its next pipeline then
    waits for this node's next answer)."""
    message = (
        Joined(nodes.node_rank, nodes.pipeline) if reason is None else Refused(nodes.node_rank, nodes.pipeline, reason)
    )
    with contextlib.suppress(OSError, EOFError, AuthenticationError), nodes.connect() as connection:
        connection.send(message)


def join_pipeline(nodes: Nodes, timeout_s: float) -> Nodes:
    """This node's `nodes` in node 0's pipeline after `nodes.pipeline` (the one this node ran last), with node 0's
    `terms`, once node 0 has started it: until then node 0's listener is either down (between pipelines) or that
    of the last one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with nodes.connect() as connection:
                connection.send(PipelineQuery(nodes.pipeline))
                zero = connection.recv()
                return dataclasses.replace(nodes, pipeline=zero.pipeline, terms=zero.terms)
        except (OSError, EOFError):
            time.sleep(0.2)
    host, port = nodes.report_address
    raise NodeZeroUnreachable(
        f"node 0 did not start a pipeline at {host}:{port} within --timeout {timeout_s:g} s: start node 0 "
        f"(`inference.serve --node-rank 0`), check --master-addr/--report-port, or raise --timeout"
    )


def agent_rendezvous(nodes: Nodes, timeout_s: float) -> dict:
    """The elastic agent's settings for this node's share of the ranks (`launch._agent_config`)."""
    return dict(
        min_nodes=nodes.nnodes,
        max_nodes=nodes.nnodes,
        nproc_per_node=nodes.nproc,
        run_id=f"{nodes.run_id}-{nodes.pipeline}",
        rdzv_backend="static",
        rdzv_endpoint=f"{nodes.master_addr}:{nodes.master_port}",
        rdzv_configs={"rank": nodes.node_rank, "timeout": int(timeout_s)},
    )
