"""Checkpoints at loss-token budgets: one training run gives the drafter at every budget of a curve.

`fit ... --trainer.callbacks+=paper_bench.budget.BudgetCheckpoints` (the runner puts `scripts/` on the path)
counts the loss tokens every training batch carries (`loss_mask`: the assistant tokens the drafter learns to
predict; the same data gives every method the same count), saves `DIR/budget_B.ckpt` at the first step where
the count reaches each budget `B`, records the step and the exact count in `DIR/budgets.json`, and stops the
run after the last budget. Its count is part of every checkpoint, so a run resumed from `last.ckpt` goes on
counting where it stopped.
"""

from __future__ import annotations

import json
import os

from lightning.pytorch.callbacks import Callback

RECORD = "budgets.json"


def budget_path(dirpath: str, budget: int) -> str:
    return os.path.join(dirpath, f"budget_{budget}.ckpt")


def read_reached(dirpath: str) -> dict[int, dict]:
    """{budget: {"step", "loss_tokens"}} of the budgets a run has reached and saved."""
    try:
        with open(os.path.join(dirpath, RECORD)) as f:
            return {int(b): v for b, v in json.load(f).items()}
    except FileNotFoundError:
        return {}


class BudgetCheckpoints(Callback):
    def __init__(self, budgets: list[int], dirpath: str):
        if not budgets or any(b <= 0 for b in budgets):
            raise ValueError(f"budgets={budgets}: give loss-token budgets > 0, e.g. [200000, 1000000, 4000000]")
        self.budgets, self.dirpath = sorted(budgets), dirpath
        self.seen = 0
        self.reached: dict[int, dict] = {}

    @property
    def state_key(self) -> str:
        return "BudgetCheckpoints"

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.seen = int(state_dict["seen"])

    def on_fit_start(self, trainer, pl_module) -> None:
        self.reached = read_reached(self.dirpath)  # a resumed run keeps the budgets it saved

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen += int(batch["loss_mask"].sum())
        for budget in self.budgets:
            if self.seen >= budget and budget not in self.reached:
                trainer.save_checkpoint(budget_path(self.dirpath, budget))
                self.reached[budget] = {"step": trainer.global_step, "loss_tokens": self.seen}
                self._record(trainer, self.reached)
        if all(b in self.reached for b in self.budgets):
            trainer.should_stop = True

    def _record(self, trainer, reached: dict[int, dict]) -> None:
        if trainer.is_global_zero:
            os.makedirs(self.dirpath, exist_ok=True)
            tmp = os.path.join(self.dirpath, RECORD + ".tmp")
            with open(tmp, "w") as f:
                json.dump({str(b): reached[b] for b in sorted(reached)}, f, indent=1)
            os.replace(tmp, os.path.join(self.dirpath, RECORD))
