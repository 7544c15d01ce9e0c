"""The staircase geometry of SPD, defined once (docs/DESIGN.md, "Terms", "Simulated fill levels", "The decode schedule", "Baselines and ablations").

Everything that depends on *which target states a token has reached* lives here: the stage split
`e_0..e_n`, the anchor layers, depth -> eligible anchors -> aggregation type, the depth of the j-th
in-flight token under each drafting schedule, and the view of a drafting time. Both training layouts
and the decoder import this module; nothing else re-derives these rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .errors import UserError

Schedule = Literal["pre_step", "post_step"]
Features = Literal["spd", "first_stage"]
ANCHOR_PRESETS = ("quarters", "n_scaled")
DEFAULT_ANCHORS = "n_scaled"
# The decoding modes (docs/DESIGN.md, "Baselines and ablations") that use a drafter: mode -> (schedule, features). `ar` needs none.
MODES: dict[str, tuple[Schedule, Features]] = {
    "spd": ("pre_step", "spd"),
    "post_step": ("post_step", "spd"),
    "ppsd": ("post_step", "first_stage"),
}


class GeometryError(UserError):
    """An impossible split/anchor setting; the message names the values and the fix."""


def uniform_split(num_layers: int, n: int) -> list[int]:
    """`e_s = round(s * L / n)` for s = 0..n."""
    if n < 1:
        raise GeometryError(f"n={n}: the pipeline needs at least one stage (set n >= 1)")
    if n > num_layers:
        raise GeometryError(f"n={n} stages but the target has only L={num_layers} layers: set n <= {num_layers}")
    return [round(s * num_layers / n) for s in range(n + 1)]


def check_split(split: Sequence[int], num_layers: int, n: int) -> list[int]:
    split = [int(e) for e in split]
    if len(split) != n + 1:
        raise GeometryError(
            f"stage split {split} has {len(split)} entries; n={n} stages need n+1 = {n + 1} (e_0=0 .. e_n=L)"
        )
    if split[0] != 0 or split[-1] != num_layers:
        raise GeometryError(f"stage split {split} must start at 0 and end at L={num_layers}")
    for s in range(n):
        if split[s + 1] <= split[s]:
            raise GeometryError(
                f"stage split {split}: stage {s + 1} has no layer (e_{s}={split[s]} >= e_{s + 1}={split[s + 1]}); make it strictly increasing"
            )
    return split


def anchor_preset(name: str, num_layers: int, n: int) -> list[int]:
    """The two named anchor rules (docs/DESIGN.md, "Terms"), clipped to `L` and deduplicated."""
    L = num_layers
    if name == "quarters":  # the paper: [0, L/4, L/2, 3L/4, L-1]
        raw = [0, L // 4, L // 2, (3 * L) // 4, L - 1]
    elif name == "n_scaled":  # the authors' release: [0, L/n, 3L/n, 6L/n, L-1]
        raw = [0, L // n, (3 * L) // n, (6 * L) // n, L - 1]
    else:
        raise GeometryError(
            f"unknown anchor preset {name!r}: use one of {ANCHOR_PRESETS} or an explicit list of layer indices"
        )
    return sorted({min(max(b, 0), L) for b in raw})


def check_anchors(anchors: Sequence[int], num_layers: int) -> list[int]:
    anchors = [int(b) for b in anchors]
    if not anchors or anchors[0] != 0:
        raise GeometryError(f"anchors {anchors} must start with 0 (the embedding output, which every depth can see)")
    if any(b >= c for b, c in zip(anchors, anchors[1:])):
        raise GeometryError(f"anchors {anchors} must be strictly increasing")
    if anchors[-1] > num_layers:
        raise GeometryError(f"anchor {anchors[-1]} is out of range: hidden-state indices go from 0 to L={num_layers}")
    return anchors


@dataclass(frozen=True)
class Geometry:
    """Split + anchors + drafting variant for a target with `num_layers` layers and `n` stages.

    `schedule="post_step"` drafts after the pipeline step, so every in-flight token is one stage
    deeper when the PDM reads it; `features="first_stage"` (PPSD) lets the PDM see only what the first
    stage produced: the embedding and the first stage's output `e_1`.
    """

    num_layers: int
    n: int
    split: tuple[int, ...]
    anchors: tuple[int, ...]
    schedule: Schedule = "pre_step"
    features: Features = "spd"
    _types: tuple[int, ...] = field(init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        num_layers: int,
        n: int,
        split: Sequence[int] | str | None = "uniform",
        anchors: Sequence[int] | str = DEFAULT_ANCHORS,
        schedule: Schedule = "pre_step",
        features: Features = "spd",
    ) -> Geometry:
        if num_layers < 1:
            raise GeometryError(f"num_layers={num_layers}: the target must have at least one layer")
        e = uniform_split(num_layers, n) if split in (None, "uniform") else check_split(split, num_layers, n)
        if schedule not in ("pre_step", "post_step"):
            raise GeometryError(f"unknown schedule {schedule!r}: use 'pre_step' or 'post_step'")
        if features not in ("spd", "first_stage"):
            raise GeometryError(f"unknown features {features!r}: use 'spd' or 'first_stage'")
        if features == "first_stage":
            b = [0, e[1]]
            preset = isinstance(anchors, str)
            if (preset and anchors != DEFAULT_ANCHORS) or (not preset and list(anchors) != b):  # it was dropped
                raise GeometryError(
                    f"anchors={anchors!r} with features='first_stage': PPSD's drafter reads the embedding and stage "
                    f"1's output (anchors {b}) whatever anchors say; drop anchors, or use features='spd'"
                )
        elif isinstance(anchors, str):
            b = anchor_preset(anchors, num_layers, n)
        else:
            b = check_anchors(anchors, num_layers)
        return cls(num_layers=num_layers, n=n, split=tuple(e), anchors=tuple(b), schedule=schedule, features=features)

    def __post_init__(self):
        object.__setattr__(self, "_types", tuple(self._type_of(k) for k in range(self.n + 1)))

    # -- decoding mode (docs/DESIGN.md, "Baselines and ablations") ---------------------------------------------------------------
    @property
    def mode(self) -> str:
        """The decoding mode this geometry's (schedule, features) stand for: `spd`, `post_step` or `ppsd`."""
        if self.features == "first_stage":
            return "ppsd"
        return "post_step" if self.schedule == "post_step" else "spd"

    def with_mode(self, mode: str) -> Geometry:
        """This geometry decoded in `mode`: the mode's schedule; its features must be the ones trained on."""
        if mode not in MODES:
            raise GeometryError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        schedule, features = MODES[mode]
        if features != self.features:
            raise GeometryError(
                f"--mode {mode} reads {features!r} features but this drafter was trained with "
                f"features={self.features!r}: use --mode {self.mode} or a matching drafter"
            )
        return Geometry.build(self.num_layers, self.n, list(self.split), list(self.anchors), schedule, features)

    # -- depth -> anchors -> type ---------------------------------------------------------------
    def _type_of(self, depth: int) -> int:
        reach = self.split[min(depth, 1) if self.features == "first_stage" else depth]
        return sum(1 for b in self.anchors if b <= reach)

    @property
    def num_types(self) -> int:
        """`m`: aggregation types are 1..m; type `tau` fuses the first `tau` anchors."""
        return len(self.anchors)

    def type_of(self, depth: int) -> int:
        """`tau(k) = |A(k)|`, the number of anchors eligible at depth `k` (0..n)."""
        return self._types[depth]

    def eligible(self, depth: int) -> tuple[int, ...]:
        """`A(k)`: the anchor layers a token at depth `k` has produced."""
        return self.anchors[: self.type_of(depth)]

    def representative_depth(self, tau: int) -> int:
        """`d(tau) = min{k : tau(k) = tau}` (the `type` layout); types no depth reaches map to n."""
        for k, t in enumerate(self._types):
            if t == tau:
                return k
        return self.n

    def stage_of_layer(self, layer: int) -> int:
        """The stage (1..n) that produces hidden state `layer` (0 = embedding, made by stage 1)."""
        for s in range(1, self.n + 1):
            if layer <= self.split[s]:
                return s
        raise GeometryError(f"layer {layer} is beyond L={self.num_layers}")

    def anchors_of_stage(self, stage: int) -> tuple[int, ...]:
        """Anchors that stage `stage` produces (stage 1 also produces the embedding output, 0)."""
        return tuple(b for b in self.anchors if self.stage_of_layer(b) == stage)

    # -- the staircase -------------------------------------------------------------------------
    @property
    def depth_offset(self) -> int:
        """Pre-step drafting reads the j-th newest in-flight token at depth j; post-step at j+1."""
        return 1 if self.schedule == "post_step" else 0

    def inflight_depth(self, j: int) -> int:
        """Depth at which the PDM reads the j-th newest in-flight token (j = 0 is the newest)."""
        return min(self.n, j + self.depth_offset)

    def view(self, t: int, fill: int) -> list[tuple[int, int]]:
        """`V(t)`: (depth, position) pairs the PDM reads when drafting x_{t+1} with fill `fill`.

        Positions `t-fill+1..t` are in flight at depths `inflight_depth(j)`; every older position
        is verified (depth n). Returned in position order, which is the PDM's sequence order.
        """
        if not 1 <= fill <= self.n:
            raise GeometryError(f"fill level {fill} is outside 1..n={self.n}")
        oldest = max(0, t - fill + 1)
        verified = [(self.n, i) for i in range(oldest)]
        inflight = [(self.inflight_depth(t - i), i) for i in range(oldest, t + 1)]
        return verified + inflight

    def check_target(self, num_layers: int) -> None:
        if num_layers != self.num_layers:
            raise GeometryError(
                f"the drafter was built for a target with L={self.num_layers} layers but the loaded target has L={num_layers}: load the matching target (--target) or retrain"
            )

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "n": self.n,
            "split": list(self.split),
            "anchors": list(self.anchors),
            "schedule": self.schedule,
            "features": self.features,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Geometry:
        return cls.build(
            d["num_layers"], d["n"], d["split"], d["anchors"], d.get("schedule", "pre_step"), d.get("features", "spd")
        )
