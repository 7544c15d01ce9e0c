"""Stopping `fit` by a signal: SIGTERM or a first ctrl-C ends the run after a complete step with last.ckpt saved, a
second ctrl-C at once (`validate` too, after a batch, with nothing to save).

A stop takes Lightning's own way out (its `received_sigterm` flag: Lightning raises `SIGTERMException` after the
step's scheduler update and logging, or after the validation batch it is in, and the checkpoint callback saves on
it), so a resume loses no step. A second ctrl-C is an ordinary `KeyboardInterrupt`: Lightning stops at once, and the
last periodic checkpoint is the one to resume from.

With several ranks no rank may stop on its own: a terminal's ctrl-C or a scheduler's SIGTERM reaches the ranks each
at another point of its step (or only one of them: `kill PID`), and a rank that stops alone leaves the others
waiting in a collective. Lightning's own SIGTERM handler broadcasts from inside the handler, wherever the step is,
which under DDP pairs with another rank's gradient all-reduce and hangs the run (tests/test_stopping.py), or with
the validation sync of the sanity check before the first step. So these handlers replace it from the sanity check
on, and a signal is only noted: at the end of every training step the ranks
start to agree (the largest signal number heard, over a gloo group: host memory only, never a device sync), and at
the next step's end all of them read the result and stop there together. One process stops as soon as Lightning's
loops look, after the step or the validation batch it is in. DataLoader workers ignore ctrl-C
(`spd_lightning.data.datamodule`): the main process ends them.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """The SIGINT and SIGTERM handlers of a `fit` run on this process (signal handlers are per process: one instance,
    `STOP`). `signal` is what stopped the run (None while it runs on), `presses` the ctrl-Cs heard."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self.presses = 0
        self._heard = 0  # the first signal this process heard (0: none)
        self._trainer = None
        self._previous: dict = {}
        self._group = None
        self._pending = None  # the agreement in flight (a gloo `Work`)
        self._agreed = torch.zeros(1, dtype=torch.int64)  # host memory: what the ranks reduce

    def install(self, trainer) -> None:
        """From now on SIGINT and SIGTERM on this process stop `trainer`'s fit (only the main thread handles
        signals). Call it after Lightning installed its own handlers, which it puts back at the end; called again for
        the same run, it keeps what it heard."""
        if self._trainer is trainer:
            return
        self.uninstall()
        self.signal, self.presses, self._heard, self._trainer = None, 0, 0, trainer
        if threading.current_thread() is not threading.main_thread():
            return
        if not hasattr(getattr(trainer, "_signal_connector", None), "received_sigterm"):
            log.warning("this Lightning has no SIGTERM flag where we set it: signals stop the run in its own way")
            return
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            if not dist.is_gloo_available():
                log.warning("torch has no gloo backend: SIGTERM and ctrl-C stop this run in Lightning's own way")
                return
            self._group = dist.new_group(backend="gloo")  # every rank installs, so every rank makes it
        self._previous = {signum: signal.signal(signum, self._heard_signal) for signum in SIGNALS}

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._pending is not None:
            self._pending.wait()  # every rank started it at the same step, so it ends
        if self._group is not None:
            dist.destroy_process_group(self._group)
        self._trainer, self._previous, self._group, self._pending = None, {}, None, None

    def _heard_signal(self, signum, frame) -> None:
        signum = signal.Signals(signum)
        if signum == signal.SIGINT:
            self.presses += 1
            if self.presses > 1:
                raise KeyboardInterrupt
        if self._heard:
            return
        self._heard = signum
        if self._trainer.is_global_zero:
            name = "ctrl-C" if signum == signal.SIGINT else signum.name
            again = "; press ctrl-C again to stop at once" if signum == signal.SIGINT else ""
            training = self._trainer.state.fn == TrainerFn.FITTING
            what = "after this step with last.ckpt saved" if training else "after this batch, with no result"
            log.warning("%s: stopping %s%s", name, what, again)
        if self._group is None and not self._trainer.sanity_checking:  # in the sanity check: after the first step
            self._stop(signum)

    def after_step(self) -> None:
        """At the end of every training step, with several ranks: all of them stop here if any had heard a signal by
        the end of the step before. The agreement runs on gloo's thread during the step between (`async_op`), so no
        step waits for its latency."""
        if self._trainer is None:
            return
        if self._group is None:
            if self._heard and self.signal is None:  # heard in the sanity check, where nothing can be saved
                self._stop(self._heard)
            return
        if self._pending is not None:
            self._pending.wait()
            agreed = int(self._agreed.item())
            if agreed:
                self._stop(signal.Signals(agreed))
                return
        self._agreed.fill_(self._heard)
        self._pending = dist.all_reduce(self._agreed, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def _stop(self, signum: signal.Signals) -> None:
        self.signal = signum
        # Lightning's flag for SIGTERM: its loops read it at a step's end and between validation batches (it has no
        # public setter; tests/test_stopping.py holds it to the Lightning versions we support)
        self._trainer._signal_connector.received_sigterm = True


STOP = StopSignals()
