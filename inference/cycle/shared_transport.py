"""PDM placement `shared`: the PDM's role in the process of stage 1, so n processes (n GPUs) serve n stages.

Process 0 hosts two ranks of the pipeline, stage 1 (rank 0) and the PDM (rank n); process p hosts stage
p + 1. `SharedTransport` carries the messages between the two ranks of process 0 through in-process
queues (as the simulator's `LocalTransport` does) and every other message over the process group, from
and to the process that hosts its rank. The runner is unchanged: it hosts the ranks `hosts()` names and
runs their phases in its usual order, so the tokens, N and K are those of the separate placement. What sharing
costs, and how stage 1 waits for no other process: docs/DESIGN.md, "The critical path" (Shared placement).
"""

from __future__ import annotations

from inference.cycle.transport import Arrival, DistributedTransport, LocalTransport


class SharedTransport(DistributedTransport):
    def __init__(self, n: int, names: list[str]):
        super().__init__(names)
        self.n = n
        self.local = LocalTransport(n + 1)

    def process_of(self, rank: int) -> int:
        return 0 if rank == self.n else rank

    def hosts(self, rank: int) -> bool:
        return self.process_of(rank) == self.rank

    def _both_here(self, src: int, dst: int) -> bool:
        return self.hosts(src) and self.hosts(dst)

    def send(self, src, dst, tensor, kind) -> None:
        if self._both_here(src, dst):
            self.local.send(src, dst, tensor, kind)
        else:
            super().send(src, self.process_of(dst), tensor, kind)

    def recv(self, src, dst, tensor, kind) -> None:
        if self._both_here(src, dst):
            self.local.recv(src, dst, tensor, kind)
        else:
            super().recv(self.process_of(src), dst, tensor, kind)

    def post(self, src, dst, tensor, kind) -> Arrival:
        if self._both_here(src, dst):
            return self.local.post(src, dst, tensor, kind)
        return super().post(self.process_of(src), dst, tensor, kind)

    def flush(self) -> None:
        super().flush()
        self.local.flush()
