"""NCCL's rules on every CPU run: a transport that fails where NCCL would hang, corrupt or refuse (docs/DESIGN.md,
"Processes", which lists the rules and when they are on).

`NcclRules` wraps any transport (`checked`) and raises `NcclRuleError`. A data tensor's rank device is that of the
rank's first data message, or the one given. With every rank in view (the simulators' `LocalTransport`),
`_StreamModel` replays the messages as NCCL runs them; a rank's later messages queue behind each receive it waited
on and each send `settle` waited on (on a GPU behind those on its compute stream). `nccl_backend.guard_default_group`
refuses the object collectives on the default group, which on GPUs is NCCL: a pickled broadcast there is a
host-device copy and a sync on every rank. `SPD_NCCL_EAGER_BYTES` sets the eager limit (default `EAGER_BYTES`; 0
makes every send a rendezvous).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from inference.cycle.transport import (
    CONTROL_KINDS,
    Arrival,
    DistributedTransport,
    LocalTransport,
    Transport,
    control_group,  # noqa: F401 - part of this API (the server's control traffic)
)
from inference.runtime.nccl_backend import RULES_ENV, NcclRuleError, enabled  # noqa: F401 - part of this API

EAGER_ENV = "SPD_NCCL_EAGER_BYTES"
# The largest send assumed to complete before its receive runs. NCCL guarantees none does; small ones fit in the
# connection's buffers (`NCCL_BUFFSIZE`, 4 MiB by default, split in steps and channels), so 64 KiB is a guess on
# the safe side (inferred, not measured). The decoder relies on it: its one-token messages go both ways between
# the PDM and stage 1 on one stream, which deadlocks with every send a rendezvous (tests/test_nccl_rules.py).
EAGER_BYTES = 64 * 1024
# The kinds above EAGER_BYTES at the shipped shapes (Qwen3.5-9B, bf16 H = 4096, V_d = 32000): the prefill messages
# ([P, H] and [P, A_s, H]) and `draft_q` (32000 float32, 128 KB). Tiny test models make them small, so the model
# treats them as rendezvous whatever their size: the tests meet the real shapes' pattern of blocking sends.
LARGE_AT_REAL_SHAPES = frozenset({"act_prefill", "anchors_prefill", "draft_q"})


def checked(transport: Transport, device: torch.device | None = None) -> Transport:
    """`transport` held to NCCL's rules when they are on (`SPD_NCCL_RULES=1`), else itself. `device`: the
    device of the data of every rank it hosts (default: each rank's first data message's)."""
    return NcclRules(transport, device) if enabled() else transport


class NcclRules(Transport):
    def __init__(self, inner: Transport, device: torch.device | None = None, eager: int | None = None):
        self.inner = inner
        self.device = device
        self.devices: dict[int, torch.device] = {}
        # The stream model needs every rank's messages: only a transport that hosts them all can give them.
        eager = int(os.environ.get(EAGER_ENV, EAGER_BYTES)) if eager is None else eager
        self.model = _StreamModel(eager) if type(inner) is LocalTransport else None

    def __getattr__(self, name):  # the inner transport's other attributes (`gather`, `rank`, `local`, ...)
        if name == "inner":  # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def hosts(self, rank: int) -> bool:
        return self.inner.hosts(rank)

    def send(self, src, dst, tensor, kind) -> None:
        self._check(src, tensor, kind, f"the {kind} rank {src} sends to rank {dst}")
        if self.model is not None:
            self.model.issue(src, dst, src, tensor, kind, blocking=False)
        self.inner.send(src, dst, tensor, kind)

    def recv(self, src, dst, tensor, kind) -> None:
        self._check(dst, tensor, kind, f"the {kind} rank {dst} receives from rank {src}")
        if self.model is not None:
            self.model.issue(src, dst, dst, tensor, kind, blocking=True)
        self.inner.recv(src, dst, tensor, kind)

    def post(self, src, dst, tensor, kind) -> Arrival:
        self._check(dst, tensor, kind, f"the {kind} rank {dst} receives from rank {src}")
        op = None if self.model is None else self.model.issue(src, dst, dst, tensor, kind, blocking=False)
        arrival = self.inner.post(src, dst, tensor, kind)
        return arrival if op is None else _ModelledArrival(arrival, self.model, op)

    def settle(self) -> None:
        if self.model is not None:
            self.model.settle()
        self.inner.settle()

    def flush(self) -> None:
        self.inner.flush()
        if self.model is not None:
            self.model.flush()

    def _check(self, rank: int, tensor: torch.Tensor, kind: str, what: str) -> None:
        if not tensor.is_contiguous():
            raise NcclRuleError(
                f"NCCL rule: {what} is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()}): "
                "NCCL moves raw memory; send and receive contiguous buffers"
            )
        if kind in CONTROL_KINDS:
            if tensor.device.type != "cpu":
                raise NcclRuleError(f"NCCL rule: {what} is on {tensor.device}: control messages live in host memory")
            if isinstance(self.inner, DistributedTransport) and dist.get_backend(self.inner._group(kind)) != "gloo":
                raise NcclRuleError(f"NCCL rule: {what} travels outside the gloo group: control goes over gloo")
            return
        expected = self.devices.setdefault(rank, self.device or tensor.device)
        if tensor.device != expected:
            raise NcclRuleError(f"NCCL rule: {what} is on {tensor.device}, but rank {rank} computes on {expected}")


class _ModelledArrival(Arrival):
    """A posted receive: the host's `wait()` (or a `ready()` that says it is in) makes it a gate of its rank."""

    def __init__(self, inner: Arrival, model: _StreamModel, op: _Op):
        self.inner, self.model, self.op = inner, model, op

    def ready(self) -> bool:
        ready = self.inner.ready()
        if ready:
            self.model.gate(self.op)
        return ready

    def wait(self) -> None:
        self.inner.wait()
        self.model.gate(self.op)


@dataclass(eq=False)
class _Op:
    src: int
    dst: int
    rank: int  # the rank that issues it (src for a send, dst for a receive)
    kind: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    rendezvous: bool  # a send that completes only once its receive runs
    after: list = field(default_factory=list)  # the gates of its rank it waits for
    partner: _Op | None = None
    started: bool = False
    done: bool = False

    @property
    def is_send(self) -> bool:
        return self.rank == self.src

    def describe(self) -> str:
        verb = f"send of {self.kind} to rank {self.dst}" if self.is_send else f"receive of {self.kind} from {self.src}"
        size = f"{self.nbytes} bytes" + (", a rendezvous" if self.rendezvous else "")
        return f"rank {self.rank}'s {verb} ({size})"


class _StreamModel:
    """Every rank's messages as NCCL would run them (see the module docstring): each op starts once it heads its
    stream (its rank, its peer, data or control) and the gates its rank set before it are done."""

    def __init__(self, eager: int):
        self.eager = eager
        self.streams: dict[tuple[int, int, bool], deque[_Op]] = {}
        self.unmatched: dict[tuple[int, int, bool], tuple[deque[_Op], deque[_Op]]] = {}  # (sends, receives)
        self.gates: dict[int, list[_Op]] = {}
        self.sent_now: list[_Op] = []
        self.sent_before: list[_Op] = []

    def issue(self, src: int, dst: int, rank: int, tensor: torch.Tensor, kind: str, blocking: bool) -> _Op:
        control = kind in CONTROL_KINDS
        nbytes = tensor.numel() * tensor.element_size()
        op = _Op(src, dst, rank, kind, tuple(tensor.shape), tensor.dtype, nbytes, False)
        big = nbytes > self.eager or kind in LARGE_AT_REAL_SHAPES
        op.rendezvous = op.is_send and not control and big  # gloo (control) sends never wait
        gates = self.gates.setdefault(rank, [])
        gates[:] = [g for g in gates if not g.done]
        op.after = list(gates)
        self._match(op, control)
        self.streams.setdefault((rank, dst if op.is_send else src, control), deque()).append(op)
        if op.is_send:
            self.sent_now.append(op)
        elif blocking:
            gates.append(op)
        self._progress()
        return op

    def gate(self, op: _Op) -> None:
        if not op.done:
            self.gates.setdefault(op.rank, []).append(op)

    def settle(self) -> None:
        """`DistributedTransport.settle` waits for the sends before the previous settle: each sender's later
        messages queue behind them."""
        for op in self.sent_before:
            self.gate(op)
        self.sent_before, self.sent_now = self.sent_now, []

    def flush(self) -> None:
        self.settle()
        self.settle()
        self._progress()
        stuck = [stream[0] for stream in self.streams.values() if stream]
        if stuck:
            raise NcclRuleError(
                "NCCL rule: these messages would deadlock on NCCL: "
                + "; ".join(self._why(op) for op in stuck[:4])
                + (f" (and {len(stuck) - 4} more)" if len(stuck) > 4 else "")
            )

    def _match(self, op: _Op, control: bool) -> None:
        sends, receives = self.unmatched.setdefault((op.src, op.dst, control), (deque(), deque()))
        mine, theirs = (sends, receives) if op.is_send else (receives, sends)
        if not theirs:
            mine.append(op)
            return
        other = theirs.popleft()
        op.partner, other.partner = other, op
        if (op.kind, op.shape, op.dtype) != (other.kind, other.shape, other.dtype):
            send, recv = (op, other) if op.is_send else (other, op)
            raise NcclRuleError(
                f"NCCL rule: rank {send.src} sends {send.kind} {send.shape} {send.dtype} to rank {send.dst}, which "
                f"receives {recv.kind} {recv.shape} {recv.dtype} in its place: NCCL would hang or corrupt the data"
            )

    def _progress(self) -> None:
        changed = True
        while changed:
            changed = False
            for stream in self.streams.values():
                while stream:
                    op = stream[0]
                    if not op.started and all(g.done for g in op.after):
                        op.started = changed = True
                    if op.started and not op.done:
                        self._complete(op)
                    if not op.done:
                        break
                    stream.popleft()
                    changed = True

    @staticmethod
    def _complete(op: _Op) -> None:
        """`op` has started: done if an eager send, or if its partner has started too."""
        partner = op.partner
        if op.is_send and not op.rendezvous:
            op.done = True
        elif partner is not None and partner.started:
            op.done = True
            if partner.rendezvous:  # a rendezvous completes on both sides at once
                partner.done = True

    @staticmethod
    def _why(op: _Op) -> str:
        if not op.started:
            waits = next(g for g in op.after if not g.done)
            return f"{op.describe()} waits for {waits.describe()}"
        if op.is_send:
            return f"{op.describe()} waits for rank {op.dst} to receive it"
        return f"{op.describe()} waits for its send"
