"""What one decoded prompt reports (docs/DESIGN.md, "The decode schedule", "Speedup formulas"): tokens, N, K, alpha, counters, per-cycle timing.

Timing comes as one row per rank and cycle of the runner (docs/DESIGN.md, "One cycle over B slots", which says
which cycles a prompt's timing holds): the rank's compute (a stage's layers, or the PDM's draft), the verifier's
time, the time the rank spent in messages (sending, and waiting to receive from its peers), the cycle's wall-clock
time, and how many slots ran a real cycle in it (`SLOTS`, a count). A wasted step is charged to the cycle that
redoes it, so the rows add up to the decode time. In the simulator every rank's row is filled by the one process,
sequentially; in the distributed decoder each rank fills its own and the reporting rank gathers them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from inference.cycle.schedule import Counters

COMPUTE, VERIFY, COMM, WALL, SLOTS = range(5)
TIMING_FIELDS = 5


def max_cycles(n: int, max_new_tokens: int) -> int:
    """An upper bound on K: at worst every token costs n cycles (an always-wrong drafter)."""
    return n * max_new_tokens + n


def summarize_timing(
    rows: torch.Tensor,
    n: int,
    cycles: tuple[int, int] | None = None,
    shared_pdm: bool = False,
) -> dict:
    """`rows[world, cycles, TIMING_FIELDS]` (ranks 0..n-1 are stages, rank n the PDM) -> JSON-ready dict, of the
    rows `cycles` = [first, end) when given (one prompt's, which the dict names). `shared_pdm` (the PDM in stage
    1's process, `--pdm-placement shared`) adds what sharing costs."""
    rows = rows.double() if cycles is None else rows[:, slice(*cycles)].double()
    stage = rows[:n, :, COMPUTE].T  # [K, n]
    draft = rows[n, :, COMPUTE]  # a replay drafter's too: what the PDM rank spent, in the simulator as on ranks
    verify = rows[n - 1, :, VERIFY]
    comm = rows[:, :, COMM].max(dim=0).values
    wall = rows[n - 1, :, WALL]
    slots = rows[n - 1, :, SLOTS]  # the verifier's process counts them
    series = {"stage_compute_s": stage, "draft_s": draft, "verify_s": verify, "comm_s": comm, "wall_s": wall}
    per_cycle = {"slots": slots.int().tolist(), **{name: values.tolist() for name, values in series.items()}}
    slowest = stage.max(dim=1).values
    totals = {
        **{name: values.sum(0).tolist() for name, values in series.items()},  # stage_compute_s: one sum per stage
        "mean_cycle_s": _mean(wall),
        "mean_slowest_stage_s": _mean(slowest),
        "mean_draft_s": _mean(draft),
        "mean_slots": _mean(slots),
    }
    if shared_pdm:
        # Stage 1's process also drafts: per cycle its busy time is its stage plus the draft's time on its critical
        # path (on a GPU the part of the draft that its own CUDA stream did not hide behind the forward,
        # `shared_stream`; on the CPU the whole draft). The cost is how far that exceeds the slowest stage.
        shared = stage[:, 0] + draft
        cost = (shared - slowest).clamp(min=0)
        per_cycle["shared_process_s"], per_cycle["sharing_cost_s"] = shared.tolist(), cost.tolist()
        totals["mean_shared_process_s"] = _mean(shared)
        totals["mean_sharing_cost_s"] = _mean(cost)
    return {"per_cycle": per_cycle, "totals": totals, **({"cycles": list(cycles)} if cycles else {})}


def _mean(values: torch.Tensor) -> float:
    return float(values.mean()) if len(values) else 0.0  # no cycle: 0, not NaN


@dataclass(kw_only=True)
class DecodeResult:
    mode: str  # spd | post_step | ppsd | ar | eagle3
    n: int
    prompt_len: int
    tokens: list[int]
    K: int
    stop_reason: str
    counters: dict = field(default_factory=dict)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    timing: dict = field(default_factory=dict)
    text: str | None = None

    @property
    def N(self) -> int:
        return len(self.tokens)

    @property
    def alpha(self) -> float | None:
        """Step acceptance ratio N / K; undefined for plain AR and when no cycle ran."""
        return self.N / self.K if self.mode != "ar" and self.K > 0 else None

    @property
    def theoretical_speedup(self) -> float | None:
        """`S0 = n * alpha`: the speedup with a free drafter and free communication."""
        return None if self.alpha is None else self.n * self.alpha

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens produced after prefill per second of decode wall-clock (the first comes from prefill)."""
        return (self.N - 1) / self.decode_s if self.decode_s > 0 and self.N > 1 else None

    def to_dict(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "counters"}
        derived = ("N", "alpha", "theoretical_speedup", "decode_tokens_per_s")
        return {**fields, **{name: getattr(self, name) for name in derived}, **self.counters}

    @classmethod
    def from_dict(cls, d: dict) -> DecodeResult:
        """The result `to_dict` wrote (its derived values recomputed, its counters gathered back)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"counters"}
        counters = {f.name for f in dataclasses.fields(Counters)}
        return cls(**{k: v for k, v in d.items() if k in names}, counters={k: v for k, v in d.items() if k in counters})
