"""Ctrl-C in `fit`: the first press stops the run after a complete step with last.ckpt saved, the second at once.

The first press takes the path SIGTERM takes (Lightning's `received_sigterm`: Lightning raises `SIGTERMException`
after the step's scheduler update and logging, or after the validation batch it is in, and the checkpoint callback
saves on it), so a resume loses no step. A second press is an ordinary `KeyboardInterrupt`: Lightning stops at once,
and the last periodic checkpoint is the one to resume from.

With several ranks no rank may stop on its own: a terminal's ctrl-C reaches every rank, each at another point of
its step, and a rank that stops alone leaves the others waiting in a collective. So a press is only noted: at the
end of every training step the ranks start to agree (the most presses over a gloo group: host memory only, never a
device sync), and at the next step's end all of them read the result and stop there together if any was pressed.
One process stops as SIGTERM would, after the step or the validation batch it is in. DataLoader workers ignore
ctrl-C (`spd_lightning.data.datamodule`): the main process ends them.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class CtrlC:
    """The SIGINT handler of a `fit` run on this process (signal handlers are per process: one instance, `CTRL_C`)."""

    def __init__(self) -> None:
        self.presses = 0
        self._trainer = None
        self._previous = None
        self._group = None
        self._pending = None  # the agreement in flight (a gloo `Work`)
        self._agreed = torch.zeros(1, dtype=torch.int64)  # host memory: what the ranks reduce

    def install(self, trainer) -> None:
        """From now on a ctrl-C on this process stops `trainer`'s fit (only the main thread may handle signals)."""
        self.uninstall()
        self.presses, self._trainer = 0, trainer
        if threading.current_thread() is not threading.main_thread():
            return
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # every rank installs, so every rank makes it
        self._previous = signal.signal(signal.SIGINT, self._pressed)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self._pending is not None:
            self._pending.wait()  # every rank started it at the same step, so it ends
        if self._group is not None:
            dist.destroy_process_group(self._group)
        self._trainer = self._previous = self._group = self._pending = None

    @property
    def stopped_the_run(self) -> bool:
        return self.presses > 0

    def _pressed(self, signum, frame) -> None:
        self.presses += 1
        if self.presses > 1:
            raise KeyboardInterrupt
        if self._trainer.is_global_zero:
            log.warning("ctrl-C: stopping after this step with last.ckpt saved; press ctrl-C again to stop at once")
        if self._group is None:
            self._stop()

    def after_step(self) -> None:
        """At the end of every training step, with several ranks: all of them stop here if any had been pressed by
        the end of the step before. The agreement runs on gloo's thread during the step between (`async_op`), so
        no step waits for its latency."""
        if self._group is None or self._trainer is None:
            return
        if self._pending is not None:
            self._pending.wait()
            if self._agreed.item():
                self.presses = max(self.presses, 1)
                self._stop()
                return
        self._agreed.fill_(self.presses)
        self._pending = dist.all_reduce(self._agreed, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def _stop(self) -> None:
        # Lightning's flag for SIGTERM: its loops read it at a step's end and between validation batches (it has no
        # public setter; tests/test_ctrl_c.py holds it to the Lightning versions we support)
        self._trainer._signal_connector.received_sigterm = True


CTRL_C = CtrlC()
