"""The paper's experiments on the benchmark targets: `python scripts/bench_paper.py --help` (scripts/paper_bench/cli.py
holds the usage; the suites and runs are in scripts/paper_bench/registry.py)."""

from __future__ import annotations

import os
import sys

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]  # the repository root (its packages) and paper_bench

from paper_bench.cli import main, parse_args  # noqa: F401 - parse_args: the tests build a run's arguments
from paper_bench.runner import eval_command, train_command  # noqa: F401 - what the tests check per run

if __name__ == "__main__":
    sys.exit(main())
