"""The benchmark registry: the runs of each suite (target + drafters), their tables, the evaluation sets."""

from __future__ import annotations

from typing import NamedTuple

from spd_lightning.errors import UserError

SETS = {
    "gsm8k": "../shared/data/gsm8k_question.jsonl",
    "humaneval": "../shared/data/humaneval_question.jsonl",
    "sharegpt": "runs/bench/sharegpt.jsonl",
}


class BenchError(UserError):
    """A bad argument or a failed run; one line."""


class Run(NamedTuple):
    n: int
    L_s: int
    mode: str  # a key of spd_lightning.geometry.MODES
    layout: str = "depth"
    anchors: str = "n_scaled"
    # Equal wall-clock: (reference, twin) trains this run for the steps the reference took times the reference's
    # minutes over the twin's (the twin is this run's configuration trained for equal steps).
    wall_of: tuple[str, str] | None = None


# The base run is spd_n4_L1 (the config as written).
TINY_RUNS = {
    "spd_n2_L3": Run(2, 3, "spd"),
    "spd_n4_L1": Run(4, 1, "spd"),
    "spd_n8_L1": Run(8, 1, "spd"),
    "ppsd_n2_L3": Run(2, 3, "ppsd"),
    "ppsd_n4_L1": Run(4, 1, "ppsd"),
    "ppsd_n8_L1": Run(8, 1, "ppsd"),
    "spd_n4_L2": Run(4, 2, "spd"),
    "spd_n4_L3": Run(4, 3, "spd"),
    "spd_n4_L4": Run(4, 4, "spd"),
    "post_n4_L1": Run(4, 1, "post_step"),
    "type_n4_L1": Run(4, 1, "spd", layout="type"),
    "quarters_n4_L1": Run(4, 1, "spd", anchors="quarters"),
}


TINY_TABLES = {
    "Table 2 shape: SPD vs PPSD across n (L_s = max(1, L/n - 1) with L = 8)": [
        "spd_n2_L3",
        "spd_n4_L1",
        "spd_n8_L1",
        "ppsd_n2_L3",
        "ppsd_n4_L1",
        "ppsd_n8_L1",
    ],
    "Table 3 shape: PDM depth L_s at n = 4": ["spd_n4_L1", "spd_n4_L2", "spd_n4_L3", "spd_n4_L4"],
    "Table 4 shape: pre-step vs post-step drafting at n = 4, L_s = 1": ["spd_n4_L1", "post_n4_L1"],
    "Training layout: depth vs type at n = 4, L_s = 1, equal steps": ["spd_n4_L1", "type_n4_L1"],
    "Anchor presets at n = 4, L_s = 1": ["spd_n4_L1", "quarters_n4_L1"],
}


# The deeper (16-layer) target: L_s = 3 everywhere (the paper's configuration); the base run is spd_n4_L3.
DEEP_RUNS = {
    "spd_n2_L3": Run(2, 3, "spd"),
    "spd_n4_L3": Run(4, 3, "spd"),
    "spd_n8_L3": Run(8, 3, "spd"),
    "ppsd_n2_L3": Run(2, 3, "ppsd"),
    "ppsd_n4_L3": Run(4, 3, "ppsd"),
    "ppsd_n8_L3": Run(8, 3, "ppsd"),
    "type_n4_L3": Run(4, 3, "spd", layout="type"),
    "type_n8_L3": Run(8, 3, "spd", layout="type"),
    "type_n4_L3_wall": Run(4, 3, "spd", layout="type", wall_of=("spd_n4_L3", "type_n4_L3")),
    "type_n8_L3_wall": Run(8, 3, "spd", layout="type", wall_of=("spd_n8_L3", "type_n8_L3")),
}


DEEP_TABLES = {
    "Table 2 shape on the 16-layer target: SPD vs PPSD across n (L_s = 3)": [
        "spd_n2_L3",
        "spd_n4_L3",
        "spd_n8_L3",
        "ppsd_n2_L3",
        "ppsd_n4_L3",
        "ppsd_n8_L3",
    ],
    "Training layout at L_s = 3: depth vs type, equal steps": ["spd_n4_L3", "type_n4_L3", "spd_n8_L3", "type_n8_L3"],
    "Training layout at L_s = 3: depth vs type, equal wall-clock": [
        "spd_n4_L3",
        "type_n4_L3_wall",
        "spd_n8_L3",
        "type_n8_L3_wall",
    ],
}


# SmolLM2-135M-Instruct (30 layers, a real chat model, its GGUF converted once): SPD at n = 2, 4, 8 with L_s = 1
# and 3, PPSD at L_s = 1 as the paper defines its baseline; every run trains on the same data for the same steps
# (configs/bench_smollm2.yaml). At L_s = 1 the `type` layout (exact there, and the shipped recipe's); at L_s = 3
# `depth` (the layout that is exact for any L_s). The base run is spd_n4_L1.
SMOLLM2_RUNS = {
    "spd_n2_L1": Run(2, 1, "spd", layout="type"),
    "spd_n4_L1": Run(4, 1, "spd", layout="type"),
    "spd_n8_L1": Run(8, 1, "spd", layout="type"),
    "spd_n2_L3": Run(2, 3, "spd"),
    "spd_n4_L3": Run(4, 3, "spd"),
    "spd_n8_L3": Run(8, 3, "spd"),
    "ppsd_n2_L1": Run(2, 1, "ppsd", layout="type"),
    "ppsd_n4_L1": Run(4, 1, "ppsd", layout="type"),
    "ppsd_n8_L1": Run(8, 1, "ppsd", layout="type"),
}
SMOLLM2_TABLES = {
    "SmolLM2-135M-Instruct: SPD vs PPSD across n at L_s = 1": [
        "spd_n2_L1",
        "spd_n4_L1",
        "spd_n8_L1",
        "ppsd_n2_L1",
        "ppsd_n4_L1",
        "ppsd_n8_L1",
    ],
    "SmolLM2-135M-Instruct: SPD at L_s = 3": ["spd_n2_L3", "spd_n4_L3", "spd_n8_L3"],
}


class Curve(NamedTuple):
    """Speedup against training budget (scripts/paper_bench/curve.py): drafters trained once each on the same data
    and seed, saved at every budget of loss tokens, evaluated on `limit` prompts per set, `max_new_tokens` each."""

    runs: dict[str, Run]  # PDM drafters, trained from one state cache
    eagle3: dict[str, int]  # EAGLE-3 drafters (one layer): name -> TTT steps
    budgets: tuple[int, ...]  # loss tokens
    tokens_per_step: int  # an estimate of the loss tokens per step, to set max_steps (--tokens-per-step)
    ks: tuple[int, ...] = (1, 2, 3, 5, 7)
    limit: int = 40
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    also_serves: tuple[str, ...] = ()  # fit configs on the same data whose anchors and seed layers the cache adds


# SPD at n = 4 and 8 with L_s = 1 (the `type` layout, exact there) and L_s = 3 (`depth`), PPSD at n = 8, L_s = 1,
# EAGLE-3 with 7 TTT steps. About 490 loss tokens per step on the regenerated data at batch 4 (inferred from
# 4 M tokens ~ 1.3 CPU hours at 0.57 s per step).
SMOLLM2_CURVE = Curve(
    {
        "curve_spd_n4_L1": Run(4, 1, "spd", layout="type"),
        "curve_spd_n4_L3": Run(4, 3, "spd"),
        "curve_spd_n8_L1": Run(8, 1, "spd", layout="type"),
        "curve_spd_n8_L3": Run(8, 3, "spd"),
        "curve_ppsd_n8_L1": Run(8, 1, "ppsd", layout="type"),
    },
    {"curve_eagle3": 7},
    (200_000, 1_000_000, 4_000_000),
    490,
    also_serves=("configs/smollm2.yaml",),  # the committed drafter trains from it (scripts/train_smollm2.sh)
)
# The same machinery at toy budgets on the 8-layer target (and the tests' 4-layer one): n <= 4.
TINY_CURVE = Curve(
    {
        "curve_spd_n2_L1": Run(2, 1, "spd", layout="type"),
        "curve_spd_n4_L1": Run(4, 1, "spd", layout="type"),
        "curve_spd_n4_L2": Run(4, 2, "spd"),
        "curve_ppsd_n4_L1": Run(4, 1, "ppsd", layout="type"),
    },
    {"curve_eagle3": 2},
    (2_000, 5_000, 10_000),
    100,
    ks=(1, 2, 3),
    limit=10,
    max_new_tokens=32,
)


class Suite(NamedTuple):
    """A target and the drafters trained on it: defaults for --config/--root/--target/--calibration/--checks and
    the marked region of the docs its tables replace."""

    config: str
    root: str
    target: str
    runs: dict[str, Run]
    tables: dict[str, list[str]]
    region: str
    calibration: str
    checks: list[str]
    curve: Curve | None = None


SUITES = {
    "tiny": Suite(
        "configs/bench_tiny.yaml",
        "runs/bench",
        "artifacts/bench_target",
        TINY_RUNS,
        TINY_TABLES,
        "paper-tables",
        "spd_n4_L1",
        ["spd_n4_L3", "spd_n2_L3"],
        TINY_CURVE,
    ),
    "deep": Suite(
        "configs/bench_deep.yaml",
        "runs/bench_deep",
        "artifacts/deep_target",
        DEEP_RUNS,
        DEEP_TABLES,
        "deep-tables",
        "spd_n4_L3",
        ["spd_n2_L3", "spd_n8_L3"],
    ),
    "smollm2": Suite(
        "configs/bench_smollm2.yaml",
        "runs/bench_smollm2",
        "artifacts/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        SMOLLM2_RUNS,
        SMOLLM2_TABLES,
        "smollm2-tables",
        "spd_n4_L1",
        ["spd_n4_L3", "spd_n8_L1"],
        SMOLLM2_CURVE,
    ),
}


# EAGLE-3 baseline runs (docs/EAGLE3.md): name -> TTT steps. Trained on the same data, trainer and steps as
# the config's PDM (its model section swapped for the EAGLE-3 drafter's), evaluated at each of EAGLE3_EVAL_K.
EAGLE3_RUNS = {"eagle3_k7": 7}


EAGLE3_EVAL_K = ("1", "2", "3", "5", "7")
