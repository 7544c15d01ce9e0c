"""How the ranks' messages travel: in-process queues (the simulator) or torch.distributed point-to-point.

The pipeline runner names every message by (source rank, destination rank, kind) and every rank derives
the same message sequence from the same schedule, taking part only in the messages that involve it.
Sends never block (`isend`): a rank waits only to receive what it needs, so no rank ever waits for a
peer to catch up with it, and with sends that cannot block, a set of blocking receives cannot deadlock
as long as every receive's send comes earlier in the sender's program (the schedule guarantees it).
Between any two ranks the messages of all kinds travel in one order on both sides, which is what NCCL
needs (it ignores tags); the local transport checks that order, so the one-process simulator is also a
test of the distributed protocol. The control messages (the verdict) travel in host memory over a gloo group
of their own, in their own order: a stage rank learns the verdict without reading device memory (under NCCL
a read of a received GPU tensor would wait for everything its device has queued).

The buffers are the runner's (`messages.py`). Every blocking call is bounded by the process-group timeout, and a
failed message raises `PeerError` naming the peer.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from inference.runtime.nccl_backend import enabled, failure_reason, guard_default_group

# the kinds of the control messages (host memory, the gloo group): the verdict is the only one
CONTROL_KINDS = frozenset({"verdict"})


class PeerError(RuntimeError):
    """A message to or from another rank failed: the peer died, stalled past the timeout, or left."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


class Transport:
    """The interface the runner uses; `hosts(rank)` tells which ranks' roles live in this process."""

    def hosts(self, rank: int) -> bool:
        raise NotImplementedError

    def send(self, src: int, dst: int, tensor: torch.Tensor, kind: str) -> None:
        """Start sending; `tensor` must stay unchanged until `settle` has run twice after this call."""
        raise NotImplementedError

    def recv(self, src: int, dst: int, tensor: torch.Tensor, kind: str) -> None:
        """Receive into `tensor`, blocking until the message is there."""
        raise NotImplementedError

    def post(self, src: int, dst: int, tensor: torch.Tensor, kind: str) -> Arrival:
        """Start receiving into `tensor` without blocking; the `Arrival` tells when it is in."""
        raise NotImplementedError

    def settle(self) -> None:
        """Once per step: wait for the sends issued before the previous `settle` (bounded bookkeeping)."""

    def flush(self) -> None:
        """At the end of a prompt: every send has completed and nothing is left in flight."""


class Arrival:
    """A receive in progress: `ready()` says without blocking whether the message is in, `wait()` blocks
    until it is (and raises `PeerError` if it never comes)."""

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class LocalTransport(Transport):
    """All ranks in this process: one queue per (src, dst), exactly like a point-to-point channel.

    Each message is copied when sent, so a sender may reuse its buffer at once. A receive that finds no
    message, or a message of another kind, is a protocol error of the runner and raises at once."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._queues: dict[tuple[int, int], deque] = {}

    def hosts(self, rank: int) -> bool:
        return 0 <= rank < self.world_size

    def send(self, src, dst, tensor, kind) -> None:
        self._queues.setdefault((src, dst), deque()).append((kind, tensor.clone()))

    def recv(self, src, dst, tensor, kind) -> None:
        queue = self._queues.get((src, dst))
        if not queue:
            raise RuntimeError(f"protocol error: rank {dst} receives {kind!r} from rank {src}, which sent nothing")
        sent_kind, payload = queue.popleft()
        if sent_kind != kind:
            raise RuntimeError(
                f"protocol error: rank {dst} expects {kind!r} from rank {src} but the next message is {sent_kind!r}"
            )
        tensor.copy_(payload)

    def post(self, src, dst, tensor, kind) -> Arrival:
        self.recv(src, dst, tensor, kind)  # in one process a sent message is always there already
        return Arrival()

    def flush(self) -> None:
        left = {pair: [kind for kind, _ in q] for pair, q in self._queues.items() if q}
        if left:
            raise RuntimeError(f"protocol error: messages sent but never received: {left}")


class DistributedTransport(Transport):
    """One rank per process over an initialized default process group."""

    def __init__(self, names: list[str]):
        """`names[r]` says what rank `r` is (e.g. "stage 2"), for error messages."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_distributed first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.names = names
        self._watched: queue.SimpleQueue | None = None  # posted receives, waited on by the watcher thread
        self._sent_now: list[tuple[object, int, str]] = []  # (work, dst, kind) since the last settle
        self._sent_before: list[tuple[object, int, str]] = []
        self._control = control_group()

    def hosts(self, rank: int) -> bool:
        return rank == self.rank

    def _group(self, kind: str):
        return self._control if kind in CONTROL_KINDS else None

    def send(self, src, dst, tensor, kind) -> None:
        try:
            work = dist.isend(tensor, dst, group=self._group(kind))
        except RuntimeError as e:
            raise _peer_error(f"cannot send {kind} to rank {dst} ({self.names[dst]})", dst, e) from e
        self._sent_now.append((work, dst, kind))  # the work keeps the tensor alive until it completes

    def recv(self, src, dst, tensor, kind) -> None:
        try:
            dist.recv(tensor, src, group=self._group(kind))
        except RuntimeError as e:
            raise _peer_error(f"no {kind} from rank {src} ({self.names[src]})", src, e) from e

    def post(self, src, dst, tensor, kind) -> Arrival:
        """NCCL's receive `Work` polls its GPU event (`is_completed`). Gloo's reports completion only to a
        thread blocked in its `wait()`, so one watcher thread waits on every posted gloo receive, in
        order, and flags each when it is in."""
        what = f"no {kind} from rank {src} ({self.names[src]})"
        group = self._group(kind)
        try:
            work = dist.irecv(tensor, src, group=group)
        except RuntimeError as e:
            raise _peer_error(what, src, e) from e
        if dist.get_backend(group) == "nccl":
            return _PostedArrival(work, what, src, watched=False)
        if self._watched is None:
            self._watched = queue.SimpleQueue()
            threading.Thread(target=_watch, args=(self._watched,), name="spd-arrivals", daemon=True).start()
        arrival = _PostedArrival(work, what, src, watched=True)
        self._watched.put(arrival)
        return arrival

    def settle(self) -> None:
        for work, dst, kind in self._sent_before:
            try:
                work.wait()
            except RuntimeError as e:
                raise _peer_error(f"rank {dst} ({self.names[dst]}) never took the {kind} sent to it", dst, e) from e
        self._sent_before, self._sent_now = self._sent_now, []

    def flush(self) -> None:
        self.settle()
        self.settle()

    def gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape everywhere) on rank `dst`, None elsewhere; once per prompt."""
        # all_gather rather than gather: both gloo and NCCL implement it.
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)
        return out if self.rank == dst else None


class _PostedArrival(Arrival):
    def __init__(self, work, what: str, peer: int, watched: bool):
        self.work, self.what, self.peer = work, what, peer
        self.done = threading.Event() if watched else None  # set by the watcher thread
        self.error: Exception | None = None

    def ready(self) -> bool:
        if self.done is None:
            return self.work.is_completed()
        return self.done.is_set() and self.error is None

    def wait(self) -> None:
        if self.done is None:
            try:
                self.work.wait()
            except RuntimeError as e:
                raise _peer_error(self.what, self.peer, e) from e
            return
        self.done.wait()  # the watcher's wait is bounded by the process-group timeout
        if self.error is not None:
            raise _peer_error(self.what, self.peer, self.error) from self.error


_control_groups: dict[int, object] = {}


def control_group(timeout: timedelta | None = None):
    """The gloo group of the control traffic (the verdict, the server's requests), one per process group: created (a
    collective) by `init_distributed` with the process group's timeout, or else by the first caller (torch's default
    timeout), on every rank at the same point of its program."""
    key = id(dist.group.WORLD)
    if key not in _control_groups:
        _control_groups[key] = dist.new_group(backend="gloo", timeout=timeout)
    return _control_groups[key]


def _watch(watched: queue.SimpleQueue) -> None:
    while True:
        arrival = watched.get()
        try:
            arrival.work.wait()
        except RuntimeError as e:
            arrival.error = e
        arrival.done.set()


def _peer_error(what: str, peer: int, cause: Exception) -> PeerError:
    return PeerError(f"{what}: {failure_reason(cause)}", peer)  # one line, gloo's or NCCL's


def init_distributed(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the process group (its address from the environment, `env://`) and make its control group; every later
    blocking call, on either group, fails after `timeout_s` instead of hanging. Under NCCL a failed or timed-out
    message kills the rank (its watchdog: `runtime/nccl_backend.py` says why we keep that)."""
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    control_group(timeout)  # gloo's own default would be 30 minutes, whatever `timeout_s` says
    if enabled():  # NCCL's rules (tests): no object collective on the default group
        guard_default_group()


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
