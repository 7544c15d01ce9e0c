"""The paper benchmark behind `scripts/bench_paper.py`, one concept per module: `registry` (suites, runs, tables,
prompt sets), `runner` (the fit / eval commands and their logs), `tables` (markdown tables and plots into
docs/BENCHMARKS.md), `checks` (planner vs pipeline, repetition of the target's output), `cli` (the actions)."""
