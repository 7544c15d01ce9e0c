"""Measuring drafters against AR: `python -m inference.eval` (`run.py`, `rows.py`, `report.py`, `totals.py`), the
deployment planner `python -m inference.plan` (`plan.py`), tables, plots and repeated k-grams."""
