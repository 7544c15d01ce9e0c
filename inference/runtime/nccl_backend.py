"""NCCL in a rank process: the guard on object collectives (`transport.init_distributed`); a failed message, one line.
It lies below the cycle layer so that the transport can use it.

A failed message reads the same under gloo and NCCL: what the `PeerError` naming the peer says.

Gloo raises at the call that failed, with `[file:line]` in front of its reason ("Connection closed by peer",
"Timed out waiting ... for recv operation to complete"). NCCL fails differently: a receive whose sender died never
completes on the device, and it is the process group's watchdog that notices, after the process-group timeout, or
when NCCL reports the peer's connection lost (`ncclRemoteError`). Its error handling then kills the process: the
rank ends by SIGABRT, and the launcher says so (`processes/reports.py`). We keep that: the mode that would raise in
Python instead (`TORCH_NCCL_ASYNC_ERROR_HANDLING=2`) aborts the communicators, which ends the pending receive
kernels with their buffers unfilled, and the work already queued behind them would read those buffers (a wrong
token out of a lossless decoder), while the elastic agent sets mode 1 for its workers anyway. Where NCCL's error
does reach Python (the next call on an aborted communicator), `failure_reason` turns its text into the same one-line
reason gloo's gets.
"""

from __future__ import annotations

import os
import re

import torch.distributed as dist

RULES_ENV = "SPD_NCCL_RULES"  # "1": the decoder's transports and collectives are held to NCCL's rules (nccl_rules.py)
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


class NcclRuleError(RuntimeError):
    """The decoder's messages break a rule NCCL holds them to (nccl_rules.py)."""


def enabled() -> bool:
    return os.environ.get(RULES_ENV, "") == "1"


_TIMEOUT = "timed out, so it stalled or waits on a stalled rank"
_NCCL_REASONS = (  # (pattern in NCCL's or its watchdog's text, the reason it means), first match wins
    (re.compile(r"watchdog caught collective operation timeout.*?OpType=(\w+)", re.I | re.S), _TIMEOUT + " (NCCL {0})"),
    (re.compile(r"remote process exited|ncclRemoteError", re.I), "the peer exited or its connection failed (NCCL)"),
    (re.compile(r"communicator was aborted", re.I), "NCCL aborted the communicator after an error on another rank"),
)


def failure_reason(cause: BaseException) -> str:
    """One line (at most 240 characters) saying why a message to or from a peer failed."""
    text = str(cause).strip()
    for pattern, reason in _NCCL_REASONS:
        found = pattern.search(text)
        if found:
            return reason.format(*found.groups())
    lines = text.splitlines()
    reason = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1]) if lines else type(cause).__name__  # drop gloo's [file:line]
    if "timed out" in reason.lower() or "timeout" in reason.lower():
        reason = f"{_TIMEOUT} ({reason[:160]})"
    return reason[:240]


def guard_default_group() -> None:
    """In a rank process with the rules on: an object collective on the default group raises `NcclRuleError`."""
    for name in OBJECT_COLLECTIVES:
        real = getattr(dist, name)
        if not getattr(real, "nccl_guarded", False):
            setattr(dist, name, _guarded(name, real))


def _guarded(name: str, real):
    def collective(*args, group=None, **kwargs):
        if group is None or group is dist.group.WORLD:
            raise NcclRuleError(
                f"NCCL rule: {name} on the default group, which is NCCL on GPUs (a host-device copy and a sync of "
                "every rank each call): send control traffic over the gloo group (nccl_rules.control_group())"
            )
        return real(*args, group=group, **kwargs)

    collective.nccl_guarded = True
    return collective
