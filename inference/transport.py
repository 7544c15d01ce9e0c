"""How the ranks' messages travel: in-process copies (the simulator) or torch.distributed.

The pipeline runner names every message by (source rank, destination rank, buffer) and issues them in
one global order that every rank derives from the same schedule; a rank takes part only in the
messages that involve it. With blocking point-to-point operations that order cannot deadlock: the
earliest unfinished message always has both of its ranks waiting on it. Gloo gets plain blocking
`send`/`recv` (its `batch_isend_irecv` can hang); NCCL uses the same calls on the GPU stream.

Buffers are preallocated by the roles and have fixed shapes per message kind, so nothing is pickled
and nothing is allocated per cycle. Every blocking call is bounded by the process-group timeout.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class Transport:
    """The interface the runner uses; `hosts(rank)` tells which ranks' roles live in this process."""

    def hosts(self, rank: int) -> bool:
        raise NotImplementedError

    def transfer(self, src: int, dst: int, send: torch.Tensor | None, recv: torch.Tensor | None) -> None:
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        raise NotImplementedError


class LocalTransport(Transport):
    """All ranks in this process: a message is a copy from the sender's buffer into the receiver's."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def hosts(self, rank: int) -> bool:
        return 0 <= rank < self.world_size

    def transfer(self, src, dst, send, recv) -> None:
        recv.copy_(send)

    def broadcast(self, tensor, src) -> None:
        pass  # every role of this process reads the same control tensor


class DistributedTransport(Transport):
    """One rank per process over an initialized default process group."""

    def __init__(self):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_distributed first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def hosts(self, rank: int) -> bool:
        return rank == self.rank

    def transfer(self, src, dst, send, recv) -> None:
        if src == self.rank:
            dist.send(send, dst)
        elif dst == self.rank:
            dist.recv(recv, src)

    def broadcast(self, tensor, src) -> None:
        dist.broadcast(tensor, src)

    def gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape everywhere) on rank `dst`, None elsewhere; once per prompt."""
        # all_gather rather than gather: both gloo and NCCL implement it.
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)
        return out if self.rank == dst else None


def init_distributed(backend: str, rank: int, world_size: int, timeout_s: float, init_method: str | None = None) -> None:
    """Join the process group; every later blocking call fails after `timeout_s` instead of hanging."""
    kwargs = dict(backend=backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    if init_method is not None:
        kwargs["init_method"] = init_method
    dist.init_process_group(**kwargs)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
