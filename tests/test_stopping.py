"""Stopping `fit` by a signal (spd_lightning/training/stopping.py): SIGTERM or a first ctrl-C stops after a complete
step with last.ckpt saved, a second ctrl-C stops at once; with several ranks every rank stops at the same step,
whichever rank heard the signal. The command line itself: tests/test_resume.py (`test_ctrl_c_...`)."""

import json
import os
import signal
import sys
import time

import lightning as L
import pytest
import torch
from kit import Record, RecordSamples, SignalAt, fit_args, make_data, quiet_trainer, run_unless_hung
from lightning.pytorch.utilities.exceptions import SIGTERMException

from spd_lightning import cli
from spd_lightning.data import ChatDataModule
from spd_lightning.errors import Stopped
from spd_lightning.training.checkpoints import CheckpointOnStop
from spd_lightning.training.stopping import STOP


def handlers() -> dict:
    return {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}


def fit(chat_target, root, *callbacks, **trainer_args):
    checkpoint = CheckpointOnStop(dirpath=str(root), save_last=True, every_n_train_steps=100)
    trainer = quiet_trainer(root, [checkpoint, *callbacks], **{"accelerator": "cpu", "max_steps": 20, **trainer_args})
    trainer.fit(RecordSamples(), datamodule=make_data(chat_target))
    return trainer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_signal_stops_after_the_step_with_its_checkpoint(chat_target, tmp_path, signum):
    record, before = Record(), handlers()
    with pytest.raises(SystemExit) as stopped:  # Lightning's SIGTERMException, which `dispatch` makes exit 130/143
        fit(chat_target, tmp_path, record, SignalAt(7, signum))
    assert stopped.value.code is None and STOP.signal == signum
    assert record.steps == [1, 2, 3, 4, 5, 6, 7]  # the step signalled in is completed, no later one starts
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 7
    assert handlers() == before  # the handlers are gone with the run


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_stops_at_once(chat_target, tmp_path):
    record = Record()
    with pytest.raises(SystemExit) as stopped:
        fit(chat_target, tmp_path, record, SignalAt(4, times=2))
    assert stopped.value.code == 1 and STOP.presses == 2  # Lightning's end for a KeyboardInterrupt
    assert record.steps == [1, 2, 3] and not (tmp_path / "last.ckpt").exists()


def test_a_run_without_a_signal_leaves_the_handlers_as_they_were(chat_target, tmp_path):
    before = handlers()
    fit(chat_target, tmp_path, max_steps=2)
    assert STOP.signal is None and handlers() == before


def test_loader_workers_ignore_ctrl_c(chat_target):
    """A terminal's ctrl-C reaches the loader's workers too; they must live on to hand over the batches the step in
    progress and the validation batch in progress still fetch (the main process ends them)."""
    data = make_data(chat_target, num_workers=2)
    data.setup("fit")
    loader = data.train_dataloader()
    batches = iter(loader)
    next(batches), next(batches)  # batch i comes from worker i % 2: both workers are set up (a kill before is theirs)
    for worker in batches._workers:
        os.kill(worker.pid, signal.SIGINT)
    time.sleep(0.5)
    try:
        assert all(worker.is_alive() for worker in batches._workers)
        assert len(list(batches)) == len(loader) - 2
    finally:
        batches._shutdown_workers()  # persistent workers: none is left for a later test's fork


@pytest.mark.parametrize(
    "command, presses, raised, code, says",
    [
        ("fit", 1, SIGTERMException(), 130, "stopped by ctrl-C after a complete step, saved as last.ckpt"),
        ("fit", 0, SIGTERMException(), 143, "stopped by SIGTERM after a complete step, saved as last.ckpt"),
        ("validate", 0, SIGTERMException(), 143, "stopped by SIGTERM during validation: no result"),
        ("fit", 2, SystemExit(1), 130, "stopped at once by a second ctrl-C"),
        ("fit", 0, SystemExit(1), 130, "interrupted by ctrl-C outside a training step"),
        ("fit", 0, KeyboardInterrupt(), 130, "interrupted by ctrl-C before training began"),
    ],
)
def test_the_command_line_names_what_stopped_the_run(monkeypatch, command, presses, raised, code, says):
    def run_cli(args):
        STOP.signal, STOP.presses = signal.SIGINT if presses else signal.SIGTERM, presses
        if isinstance(
            raised, SystemExit
        ):  # Lightning's end for a ctrl-C: `sys.exit(1)` in its `except KeyboardInterrupt`
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise raised from None
        raise raised

    monkeypatch.setattr(cli, "run_cli", run_cli)
    with pytest.raises(Stopped) as stopped:
        cli.dispatch([command])
    assert stopped.value.exit_code == code and str(stopped.value).startswith(says)


def test_a_bug_that_exits_is_not_taken_for_ctrl_c(monkeypatch):
    monkeypatch.setattr(cli, "run_cli", lambda args: sys.exit(1))
    STOP.presses = 0
    with pytest.raises(SystemExit):
        cli.dispatch(["fit"])


def test_ctrl_c_while_fit_prepares_is_one_line_with_exit_130(micro_target, tmp_path, monkeypatch):
    """A ctrl-C while `fit` prepares, before its first step (the data, the target: minutes with a real model), reached
    Lightning's own handler, whose end is `sys.exit(1)`: exit code 1, a bug's, and no line. Now the line and 130."""

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(ChatDataModule, "prepare_data", interrupted)
    monkeypatch.setattr(STOP, "presses", 0)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(Stopped) as stopped:
            cli.dispatch(["fit", *fit_args(micro_target, tmp_path)])
    finally:
        signal.signal(signal.SIGINT, before)  # Lightning ignores ctrl-C once it has seen one
    assert stopped.value.exit_code == 130 and str(stopped.value).startswith("interrupted by ctrl-C"), stopped.value


def run_ranks(script_text: str, chat_target, tmp_path, signalled_rank: int, signum: int) -> tuple[list[dict], str]:
    """A 2-rank DDP script (gloo): what each rank wrote, and the output; a hang fails the test."""
    script = tmp_path / "ranks.py"
    script.write_text(script_text.format(tests=os.path.dirname(os.path.abspath(__file__))))
    args = [str(script), json.dumps(chat_target), str(tmp_path), str(signalled_rank), str(int(signum))]
    out = run_unless_hung(args, 100, "the ranks did not stop together", merge_output=True).stdout
    ranks = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(r.exists() for r in ranks), out[-3000:]
    return [json.loads(r.read_text()) for r in ranks], out


DDP_SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, {tests!r})
from kit import Record, RecordSamples, SignalAt, ddp_trainer, how_it_ended, make_data
from spd_lightning.training.checkpoints import CheckpointOnStop
from spd_lightning.training.stopping import STOP

chat_target, out, pressed_rank, signum = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
record = Record()
checkpoint = CheckpointOnStop(dirpath=out, save_last=True, every_n_train_steps=100)
callbacks = [checkpoint, record, SignalAt(3, signum, rank=pressed_rank)]
trainer = ddp_trainer(out, callbacks, max_steps=20)
end = how_it_ended(lambda: trainer.fit(RecordSamples(), datamodule=make_data(chat_target)))
with open(f"{{out}}/rank{{trainer.global_rank}}.json", "w") as f:
    json.dump({{"end": end, "steps": record.steps, "signal": STOP.signal}}, f)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "signum, pressed_rank",
    [
        pytest.param(signal.SIGINT, 1, marks=pytest.mark.slow),  # test_sigterm_in_validate_...[1] signals rank 1
        (signal.SIGTERM, 0),
        pytest.param(signal.SIGINT, 0, marks=pytest.mark.slow),  # the same handler on the other rank
        pytest.param(signal.SIGTERM, 1, marks=pytest.mark.slow),
    ],
    ids=["ctrl_c-rank1", "sigterm-rank0", "ctrl_c-rank0", "sigterm-rank1"],
)
def test_ranks_stop_together_whichever_rank_is_signalled(chat_target, tmp_path, pressed_rank, signum):
    """Lightning's DDP (gloo, 2 CPU processes): one rank hears the signal during step 3; the ranks agree on it during
    step 4 and both stop after it, and last.ckpt holds step 4. A rank that stopped alone would leave the other in a
    collective, and so does Lightning's own SIGTERM handler (a hang, seen before stopping.py took SIGTERM over)."""
    ranks, out = run_ranks(DDP_SCRIPT, chat_target, tmp_path, pressed_rank, signum)
    assert ranks == [{"end": "exit None", "steps": [1, 2, 3, 4], "signal": signum}] * 2, out[-3000:]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 4


class Validated(RecordSamples):
    def validation_step(self, batch, batch_idx):
        self.log("val/mask", batch["attention_mask"].float().mean())


class SignalInSanityCheck(L.Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.timeout(120)
def test_a_signal_in_the_sanity_check_stops_one_process_after_its_first_step(chat_target, tmp_path):
    """Lightning saves nothing in the sanity check: a stop there ended the run with no checkpoint, while the line
    said 'saved as last.ckpt'. The signal is kept for the first step's end instead, as with several ranks."""
    record, checkpoint = Record(), CheckpointOnStop(dirpath=str(tmp_path), save_last=True, every_n_train_steps=100)
    callbacks = [checkpoint, record, SignalInSanityCheck()]
    trainer = quiet_trainer(
        tmp_path,
        callbacks,
        accelerator="cpu",
        max_steps=20,
        limit_val_batches=2,
        num_sanity_val_steps=2,
        val_check_interval=10,
    )
    with pytest.raises(SystemExit):
        trainer.fit(Validated(), datamodule=make_data(chat_target, val_size=8))
    assert STOP.signal == signal.SIGTERM and record.steps == [1]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1


SANITY_CHECK_SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(1)
import lightning as L
sys.path.insert(0, {tests!r})
from kit import Record, RecordSamples, ddp_trainer, how_it_ended, make_data
from spd_lightning.training.checkpoints import CheckpointOnStop
from spd_lightning.training.stopping import STOP

chat_target, out, signalled_rank, signum = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

class Validated(RecordSamples):
    def validation_step(self, batch, batch_idx):
        self.log("val/mask", batch["attention_mask"].float().mean(), sync_dist=True)

class SignalInSanityCheck(L.Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking and batch_idx == 0 and trainer.global_rank == signalled_rank:
            os.kill(os.getpid(), signum)

record = Record()
checkpoint = CheckpointOnStop(dirpath=out, save_last=True, every_n_train_steps=100)
trainer = ddp_trainer(out, [checkpoint, record, SignalInSanityCheck()], max_steps=20, limit_val_batches=2,
                      num_sanity_val_steps=2, val_check_interval=10)
end = how_it_ended(lambda: trainer.fit(Validated(), datamodule=make_data(chat_target, val_size=8)))
with open(f"{{out}}/rank{{trainer.global_rank}}.json", "w") as f:
    json.dump({{"end": end, "steps": record.steps, "signal": STOP.signal}}, f)
"""


@pytest.mark.timeout(150)
@pytest.mark.slow  # one process: test_a_signal_in_the_sanity_check_stops_one_process_after_its_first_step
@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_sigterm_in_the_sanity_check_stops_the_ranks_together(chat_target, tmp_path, signalled_rank):
    """SIGTERM to one rank during the sanity check, before the first step: Lightning's own handler was still the one
    installed there, and its broadcast from inside the handler met the other rank's validation sync: a rank aborted on
    gloo's 'collective mismatch' (on NCCL a hang or garbage), no checkpoint, and the CLI said 'saved as last.ckpt'
    (seen for either rank). Now the signal is noted as during training: both ranks stop after step 2, last.ckpt
    saved."""
    ended, out = run_ranks(SANITY_CHECK_SCRIPT, chat_target, tmp_path, signalled_rank, signal.SIGTERM)
    assert ended == [{"end": "exit None", "steps": [1, 2], "signal": signal.SIGTERM}] * 2, out[-3000:]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2


VALIDATE_SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(1)
import lightning as L
sys.path.insert(0, {tests!r})
from kit import ddp_trainer, how_it_ended, make_data, make_module
from spd_lightning.training.checkpoints import CheckpointOnStop
from spd_lightning.training.stopping import STOP

chat_target, out, signalled_rank, signum = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

class SignalAtFirstBatch(L.Callback):
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and trainer.global_rank == signalled_rank:
            os.kill(os.getpid(), signum)

checkpoint = CheckpointOnStop(dirpath=out, save_last=True)
trainer = ddp_trainer(out, [checkpoint, SignalAtFirstBatch()], limit_val_batches=4)
module, data = make_module(chat_target["target"]), make_data(chat_target, val_size=16)
end = how_it_ended(lambda: trainer.validate(module, datamodule=data))
with open(f"{{out}}/rank{{trainer.global_rank}}.json", "w") as f:
    json.dump({{"end": end, "signal": STOP.signal}}, f)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("signalled_rank", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_sigterm_in_validate_stops_the_ranks_together(chat_target, tmp_path, signalled_rank):
    """`validate` on 2 ranks, SIGTERM to one of them at its first batch: Lightning's own handler hung both (seen);
    now the ranks agree after a batch and both stop, with nothing saved."""
    ended, out = run_ranks(VALIDATE_SCRIPT, chat_target, tmp_path, signalled_rank, signal.SIGTERM)
    assert ended == [{"end": "exit None", "signal": signal.SIGTERM}] * 2, out[-3000:]
    assert not (tmp_path / "last.ckpt").exists()
