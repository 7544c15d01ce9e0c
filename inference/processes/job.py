"""The decode job: everything a rank needs to take its part in a decode, picklable for the rank processes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from inference.processes.nodes import Nodes
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry


class Replay(NamedTuple):
    """A `ReplayDrafter` instead of a PDM: its policy and the reference continuation of each prompt."""

    policy: str
    references: Sequence[Sequence[int]]


@dataclass
class DecodeJob:
    """Everything a rank needs, picklable for the rank processes. Geometry and sampling travel as the typed
    settings the CLI or server built once: no rank re-reads them from a dict."""

    target_path: str
    geometry: Geometry
    prompts: list[list[int]]
    max_new_tokens: int
    eos_token_ids: list[int]
    vocab_size: int
    hidden_size: int
    sampling: Sampling
    drafter_path: str | None = None  # an exported drafter dir or a Lightning .ckpt
    replay: Replay | None = None
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    timeout_s: float = 120.0
    debug: bool = False
    profile: bool = False  # per-cycle timing in each result (`profiler.Profiler`)
    fault: str | None = None  # test-only, see `faults.Fault`
    trust_remote_code: bool = False
    stream: bool = False  # the verifier's rank reports each cycle's verified tokens (`launch(on_tokens=...)`)
    pdm_placement: str = "separate"  # or "shared": the PDM in stage 1's process (`shared_transport`)
    compile: bool = False  # one-token stage steps and PDM drafts through torch.compile (`capture.CompiledStep`)
    nodes: Nodes | None = None  # this node's share of the ranks when they span several nodes (`nodes`)
    max_batch: int = 1  # the slots: the prompts decode that many at a time (`launch.decode_prompts`)
    max_new_tokens_each: list[int] | None = None  # prompt i's own max_new_tokens (else the job's)
    warm_up: bool = False  # the longest request decoded once, unreported, first (`launch.decode_prompts`)

    def __post_init__(self):
        if self.replay is not None:
            self.replay = Replay(*self.replay)

    @property
    def n(self) -> int:
        return self.geometry.n

    @property
    def world_size(self) -> int:
        """Processes: n stages, plus the PDM's unless it shares stage 1's."""
        return self.n + (self.pdm_placement != "shared")

    @property
    def local_ranks(self) -> int:
        """The processes this node runs."""
        return self.world_size if self.nodes is None else self.nodes.nproc
