"""The decode job: everything a rank needs to take its part in a decode, picklable for the rank processes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from inference.processes.nodes import Nodes
from inference.sampling import Sampling
from spd_lightning.errors import UserError
from spd_lightning.geometry import Geometry
from spd_lightning.target import resolve_dtype

# What every node's ranks must share, each node building its job from its own command line: a difference makes
# the ranks exchange messages of other shapes or dtypes, or wait for ones never sent.
SHARED_TERMS = ("geometry", "vocab_size", "hidden_size", "dtype", "pdm_placement", "max_batch")


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

    def terms(self) -> tuple[tuple[str, object], ...]:
        """The settings every node's ranks must share (`SHARED_TERMS`): node 0 sends its own with the pipeline."""
        return tuple((name, self._term(name)) for name in SHARED_TERMS)

    def _term(self, name: str) -> object:
        if name == "dtype":  # one spelling of each dtype (`bf16` and `bfloat16` agree)
            return str(resolve_dtype(self.dtype)).removeprefix("torch.")
        return getattr(self, name)

    def agree(self, terms: tuple[tuple[str, object], ...], adopt: tuple[str, ...] = ()) -> None:
        """Take node 0's `terms` where this node's differ and the name is in `adopt` (a setting this node was not
        given); any other difference is one line, before a rank starts."""
        for name, value in terms:
            if self._term(name) == value:
                continue
            if name not in adopt:
                raise UserError(
                    f"this node's {name} is {self._term(name)!r}, node 0's is {value!r}: start every node with "
                    f"the same --ckpt, --target, --dtype, --pdm-placement and --max-batch"
                )
            setattr(self, name, value)

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
