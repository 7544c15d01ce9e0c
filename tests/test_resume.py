"""Resume (docs/DESIGN.md, "Loss, optimizer, checkpoints"): the data position survives a checkpoint (same order, same shard, same next batch), a
resumed run trains exactly what the uninterrupted run trains, and a killed `fit` leaves a loadable `last.ckpt`."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import lightning as L
import pytest
import torch
from kit import (
    REPO,
    Record,
    RecordSamples,
    StopAt,
    make_data,
    make_module,
    make_trainer,
    not_resumable_warnings,
    quiet_trainer,
    run_unless_hung,
    sample_keys,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy

from spd_lightning.data import ResumableSampler


# -- the sampler ---------------------------------------------------------------------------------------
def test_sampler_order_shards_and_resumes_exactly():
    data = list(range(23))
    one = ResumableSampler(data, seed=5)
    assert sorted(one) == data and list(one) == list(ResumableSampler(data, seed=5))  # a permutation, by seed
    epoch0 = list(one)
    one.set_epoch(1)
    assert list(one) != epoch0 and sorted(one) == data  # a new order every epoch
    assert list(ResumableSampler(data, seed=6)) != epoch0

    B, R = 3, 2
    shards = [list(ResumableSampler(data, R, r, seed=5)) for r in range(R)]
    assert [len(s) for s in shards] == [12, 12] and set(shards[0] + shards[1]) == set(data)  # 1 sample repeated
    for k in (1, 2, 4):  # k batches trained on each rank, then resumed: each rank continues its own shard
        for r in range(R):
            resumed = ResumableSampler(data, R, r, seed=5)
            resumed.resume_at(0, k * B * R)
            assert len(resumed) == 12 and list(resumed) == shards[r][k * B :]
            assert list(resumed) == shards[r]  # the resume applies to the next iteration only

    # the trainer moved on to another epoch than the checkpoint's: that epoch starts afresh
    moved = ResumableSampler(data, seed=5)
    moved.resume_at(0, 6)
    moved.set_epoch(1)
    assert list(moved) == list(ResumableSampler(data, seed=5).order(1))

    # 2 ranks -> 1 rank: exactly the samples not yet trained on, in the same order
    single = ResumableSampler(data, 1, 0, seed=5)
    single.resume_at(0, 2 * B * R)
    trained = set(shards[0][: 2 * B] + shards[1][: 2 * B])
    assert list(single) == [i for i in single.order(0) if i not in trained]


def saved_and_loaded(obj):
    """`obj` through torch.save and torch.load(weights_only=True), as a checkpoint carries it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_loader_state_round_trips_through_a_checkpoint_dict(chat_target):
    data = make_data(chat_target, batch_size=3)
    data.setup("fit")
    loader = data.train_dataloader()
    full = [sample_keys(b) for b in loader]
    loader.position = lambda: (5, False)  # 5 batches trained in epoch 0
    state = saved_and_loaded(data.state_dict())["train_position"]
    assert state == loader.state_dict() and state["epoch"] == 0 and state["offset"] == 15
    fresh = make_data(chat_target, batch_size=3)
    fresh.setup("fit")
    fresh.load_state_dict({"train_position": state})
    assert [sample_keys(b) for b in fresh.train_dataloader()] == full[5:]
    loader.position = lambda: (16, True)  # the epoch is over: the next one starts at its beginning
    assert (loader.state_dict()["epoch"], loader.state_dict()["offset"]) == (1, 0)


# -- data order through Lightning ----------------------------------------------------------------------
class RestoreAfterSetup(SingleDeviceStrategy):
    """Restores checkpoints after `configure_optimizers`, like FSDP, DeepSpeed and ModelParallel do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def run_order(
    chat_target,
    root,
    stop_at=None,
    ckpt_path=None,
    num_workers=0,
    save_every=None,
    callbacks_extra=(),
    estimate_steps=False,
    **trainer_args,
):
    record = Record()
    save_every = save_every or {"every_n_train_steps": 1}
    callbacks = [record, ModelCheckpoint(dirpath=str(root), save_last=True, **save_every), *callbacks_extra]
    if stop_at is not None:
        callbacks.append(StopAt(stop_at))
    if "strategy" in trainer_args:  # a strategy class: a new instance for every run
        trainer_args["strategy"] = trainer_args["strategy"](torch.device("cpu"))
    else:
        trainer_args["accelerator"] = "cpu"
    trainer = quiet_trainer(root, callbacks, **trainer_args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            RecordSamples(estimate_steps),
            datamodule=make_data(chat_target, batch_size=3, num_workers=num_workers),
            ckpt_path=ckpt_path,
        )
    return record, not_resumable_warnings(caught)


# 48 chats, 3 per batch: 16 batches per epoch, 2 epochs
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "stop_at, num_workers, setup",
    [
        (5, 0, dict(max_steps=32)),  # mid-epoch
        (16, 0, dict(max_steps=32)),  # at an epoch's end
        (21, 1, dict(max_steps=32)),  # mid-epoch in epoch 1, a worker process fetching ahead
        # an epoch-based run from a checkpoint written by `on_train_epoch_end`: Lightning does not reload loader
        # states there (the epoch is complete); the data module's state still starts the worker on epoch 1
        (16, 1, dict(max_epochs=2, max_steps=-1, save_every={"every_n_epochs": 1, "save_on_train_epoch_end": True})),
        # the loader built by `estimated_stepping_batches` (as SPDModule does) before the data module's state is
        # restored (as FSDP does): it must be rebuilt at the checkpoint's position
        (5, 0, dict(max_epochs=2, estimate_steps=True, strategy=RestoreAfterSetup)),
        (5, 0, dict(max_epochs=2, estimate_steps=True)),
    ],
    ids=["mid_epoch", "epoch_end", "epoch1_worker", "epoch_based_end", "restore_after_setup", "estimated_steps"],
)
def test_resumed_run_trains_the_same_batches(chat_target, tmp_path, stop_at, num_workers, setup):
    straight, _ = run_order(chat_target, tmp_path / "straight", num_workers=num_workers, **setup)
    assert len(straight.batches) == 32 and straight.batches[:16] != straight.batches[16:]
    first, _ = run_order(chat_target, tmp_path / "run", stop_at=stop_at, num_workers=num_workers, **setup)
    assert first.batches == straight.batches[:stop_at]
    resumed, warned = run_order(
        chat_target, tmp_path / "run", ckpt_path=str(tmp_path / "run" / "last.ckpt"), num_workers=num_workers, **setup
    )
    assert not warned
    assert resumed.steps == straight.steps[stop_at:]
    assert resumed.batches == straight.batches[stop_at:]


class SigtermAt(L.Callback):
    """Sends this process SIGTERM during step `step`: Lightning finishes the step, then raises SIGTERMException."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.timeout(120)
def test_checkpoint_saved_when_sigterm_stops_the_run_resumes_the_data(chat_target, tmp_path):
    """The checkpoint `ModelCheckpoint(save_on_exception=True)` writes when SIGTERM stops `fit` (after a complete
    step, at another point of Lightning's loop than the periodic saves) resumes the data at the next batch."""
    straight, _ = run_order(chat_target, tmp_path / "straight", max_steps=20)
    save = {"every_n_train_steps": 100, "save_on_exception": True}
    with pytest.raises(SystemExit):  # Lightning's SIGTERMException
        run_order(chat_target, tmp_path / "run", save_every=save, max_steps=20, callbacks_extra=[SigtermAt(7)])
    assert torch.load(tmp_path / "run" / "last.ckpt", weights_only=True)["global_step"] == 7
    resumed, warned = run_order(
        chat_target, tmp_path / "run", ckpt_path=str(tmp_path / "run" / "last.ckpt"), save_every=save, max_steps=20
    )
    assert not warned and resumed.steps == straight.steps[7:] and resumed.batches == straight.batches[7:]


DDP_SCRIPT = """
import json, sys, warnings
import torch
torch.set_num_threads(1)
from lightning.pytorch.callbacks import ModelCheckpoint
sys.path.insert(0, {tests!r})
from kit import Record, RecordSamples, StopAt, ddp_trainer, make_data, not_resumable_warnings

chat_target, out = json.loads(sys.argv[1]), sys.argv[2]

def run(root, stop_at=None, ckpt_path=None):
    record = Record()
    callbacks = [record, ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1)]
    callbacks += [StopAt(stop_at)] if stop_at else []
    trainer = ddp_trainer(root, callbacks, max_steps=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(RecordSamples(), datamodule=make_data(chat_target, batch_size=3), ckpt_path=ckpt_path)
    return trainer.global_rank, record, not_resumable_warnings(caught)

rank, straight, _ = run(out + "/straight")
_, first, _ = run(out + "/run", stop_at=3)
_, resumed, warned = run(out + "/run", ckpt_path=out + "/run/last.ckpt")
with open(f"{{out}}/rank{{rank}}.json", "w") as f:
    json.dump({{"straight": straight.batches, "first": first.batches, "resumed": resumed.batches,
               "steps": resumed.steps, "warned": warned}}, f)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_two_processes_resume_each_shard(chat_target, tmp_path):
    """Lightning's DDP (gloo, 2 CPU processes) keeps our sampler: the ranks split every epoch without overlap, and
    after a resume each rank trains what it would have trained without the interruption."""
    script = tmp_path / "ddp_resume.py"
    script.write_text(DDP_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run(
        [sys.executable, str(script), json.dumps(chat_target), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert not rank["warned"] and rank["steps"] == [4, 5, 6, 7, 8]
        assert rank["first"] == rank["straight"][:3] and rank["resumed"] == rank["straight"][3:]
    # 48 chats, 3 per batch on each of 2 ranks: 8 steps are one epoch, every chat exactly once
    seen = [tuple(s) for rank in ranks for batch in rank["straight"] for s in batch]
    assert len(seen) == 48 and len(set(seen)) == 48


# -- (a) the drafter: same losses after a resume -------------------------------------------------------
@pytest.mark.timeout(180)
def test_resume_gives_the_same_losses_as_the_uninterrupted_run(chat_target, tmp_path):
    def run(root, stop_at=None, ckpt_path=None):
        L.seed_everything(0)
        record = Record()
        callbacks = [record, ModelCheckpoint(dirpath=str(root), save_last=True, every_n_train_steps=1)]
        callbacks += [StopAt(stop_at)] if stop_at else []
        trainer = make_trainer(root, max_steps=7, enable_checkpointing=True, callbacks=callbacks, limit_val_batches=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(make_module(chat_target["target"]), datamodule=make_data(chat_target), ckpt_path=ckpt_path)
        assert not not_resumable_warnings(caught)
        return record

    straight = run(tmp_path / "straight")
    first = run(tmp_path / "run", stop_at=3)
    resumed = run(tmp_path / "run", ckpt_path=str(tmp_path / "run" / "last.ckpt"))
    assert straight.steps == [1, 2, 3, 4, 5, 6, 7] and resumed.steps == [4, 5, 6, 7]
    assert first.batches == straight.batches[:3] and resumed.batches == straight.batches[3:]
    assert len(set(map(tuple, map(sorted, straight.batches)))) == 7  # 7 different batches: the order matters
    torch.testing.assert_close(first.losses + resumed.losses, straight.losses, rtol=1e-5, atol=1e-6)
    assert len(set(straight.losses)) == 7


FILL_RESUME_SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
sys.path.insert(0, {tests!r})
from kit import Record, StopAt, ddp_trainer, make_data, make_module
from spd_lightning.training import module as spd_module

spd_module.REFRESH_STEPS = 3  # `fill_probs: auto` draws from new weights after steps 3 and 6
chat_target, out = json.loads(sys.argv[1]), sys.argv[2]

def run(root, stop_at=None, ckpt_path=None):
    L.seed_everything(0)
    record = Record()
    callbacks = [record, ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1)]
    callbacks += [StopAt(stop_at)] if stop_at else []
    trainer = ddp_trainer(root, callbacks, max_steps=8)
    module = make_module(chat_target["target"])
    trainer.fit(module, datamodule=make_data(chat_target, batch_size=3), ckpt_path=ckpt_path)
    return trainer.global_rank, record.losses, list(module.fill_estimate.weights)

rank, straight, weights = run(out + "/straight")
_, first, _ = run(out + "/run", stop_at=4)
_, resumed, resumed_weights = run(out + "/run", ckpt_path=out + "/run/last.ckpt")
with open(f"{{out}}/rank{{rank}}.json", "w") as f:
    json.dump({{"straight": straight, "split": first + resumed, "weights": weights,
               "resumed_weights": resumed_weights}}, f)
"""


@pytest.mark.timeout(240)
def test_ddp_resume_with_auto_fills_gives_the_same_losses(chat_target, tmp_path):
    """`fill_probs: auto` under DDP (gloo, 2 processes): each rank keeps its own running acceptance and the fill
    weights come from their sum over the ranks. The checkpoint held rank 0's alone, which every rank loaded, so from
    the first refresh after a resume the weights, the fill draws and the losses were not the uninterrupted run's."""
    script = tmp_path / "ddp_fill_resume.py"
    script.write_text(FILL_RESUME_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    proc = run_unless_hung(
        [str(script), json.dumps(chat_target), str(tmp_path)], 200, "the runs did not end", None, True
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    for rank in (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)):
        assert len(rank["straight"]) == 8
        torch.testing.assert_close(rank["resumed_weights"], rank["weights"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(rank["split"], rank["straight"], rtol=1e-5, atol=1e-6)


# -- (b) a killed `fit` leaves a loadable last.ckpt, and `--ckpt_path last` continues ---------------------
def resume_fit_args(chat_target, root, *extra: str) -> list[str]:
    """A config of its own (configs/ change with the project): the tiny target and the local chats on CPU, a
    checkpoint every step, no validation, no logger."""
    config = root / "resume.yaml"
    config.write_text(
        textwrap.dedent(f"""\
        seed_everything: 0
        trainer:
          accelerator: cpu
          devices: 1
          precision: 32-true
          max_epochs: 1
          limit_val_batches: 0
          logger: false
          enable_progress_bar: false
          enable_model_summary: false
          default_root_dir: {root}
        model:
          target: {chat_target["target"]}
          target_dtype: float32
          n: 2
          num_layers: 1
          lr: 3.0e-3
        data:
          sources: [{{path: {chat_target["data"]}}}]
          batch_size: 2
          val_size: 0
          draft_vocab_size: 64
          cache_dir: {chat_target["cache"]}
        checkpoint:
          dirpath: {root / "ckpt"}
          every_n_train_steps: 1
        """)
    )
    return ["--config", str(config), *extra]


def saved_step(path) -> int:
    try:
        return int(torch.load(path, weights_only=True)["global_step"])
    except Exception:  # noqa: BLE001 - not there yet
        return -1


def fit_and_kill(
    chat_target, root, sig, after_step: int = 3, timeout: float = 120, extra: tuple = (), group: bool = False
) -> subprocess.CompletedProcess:
    """`python -m spd_lightning fit` in a subprocess (one thread), sent `sig` once last.ckpt holds `after_step`: to
    the process, or with `group` to its whole process group, as a terminal sends ctrl-C."""
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled"}
    cmd = [
        sys.executable,
        "-m",
        "spd_lightning",
        "fit",
        *resume_fit_args(chat_target, root, "--trainer.max_steps", "1000", *extra),
    ]
    last = root / "ckpt" / "last.ckpt"
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=group
    )
    deadline = time.time() + timeout
    try:
        while saved_step(last) < after_step:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.time() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGKILL,
        # Lightning turns SIGTERM into `SIGTERMException`, a `SystemExit` without a code: the process exits 0 until
        # spd_lightning/cli.py catches it (see the resume report); remove the xfail with that change.
        pytest.param(signal.SIGTERM, marks=[pytest.mark.slow]),
    ],
    ids=["sigkill", "sigterm"],
)
def test_killed_fit_leaves_a_loadable_last_ckpt_and_resumes(chat_target, tmp_path, sig):
    from spd_lightning import cli
    from spd_lightning.export import load_drafter

    killed = fit_and_kill(chat_target, tmp_path, sig)
    last = tmp_path / "ckpt" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)  # never a half-written file
    pdm, spec = load_drafter(str(last))
    assert spec.geometry.n == 2 and sum(p.numel() for p in pdm.parameters()) > 0
    step = ckpt["global_step"]
    batch_progress = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert 3 <= step < 24 and batch_progress["processed"] == step  # mid-epoch: 48 chats, 2 per batch
    assert ckpt["ChatDataModule"]["train_position"]["offset"] == 2 * step

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = cli.run_cli(
            [
                "fit",
                *resume_fit_args(chat_target, tmp_path, "--trainer.max_steps", str(step + 2)),
                "--ckpt_path",
                "last",
            ]
        )
    assert resumed.trainer.global_step == step + 2 and not not_resumable_warnings(caught)
    assert torch.load(last, weights_only=True)["global_step"] == step + 2
    if sig == signal.SIGTERM:
        assert "SIGTERM: stopping after this step with last.ckpt saved" in killed.stdout
    assert killed.returncode != 0, killed.stdout[-2000:]


@pytest.mark.slow  # fast: test_stopping's ctrl-C after a step (in-process), its workers, test_killed_fit_...[sigkill]
@pytest.mark.timeout(180)
def test_ctrl_c_stops_fit_after_a_step_in_one_line_with_exit_130(chat_target, tmp_path):
    """ctrl-C from a terminal reaches the whole process group, the loader's workers too (`num_workers` 2, which
    ignore it): `fit` completes its step, saves it and ends with one line and exit code 130, and resumes from it."""
    killed = fit_and_kill(chat_target, tmp_path, signal.SIGINT, extra=("--data.num_workers", "2"), group=True)
    assert killed.returncode == 130, killed.stdout[-3000:]
    lines = killed.stdout.strip().splitlines()
    assert lines[-1].startswith("error: stopped by ctrl-C after a complete step, saved as last.ckpt"), lines[-5:]
    assert "Traceback" not in killed.stdout and "KeyboardInterrupt" not in killed.stdout
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    step = ckpt["global_step"]
    assert 3 <= step < 24 and ckpt["ChatDataModule"]["train_position"]["offset"] == 2 * step


# -- how Lightning writes last.ckpt ---------------------------------------------------------------------
_WRITES: list | None = None


def _audit(event, args):
    if _WRITES is None:
        return
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = args[1], args[2]
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR))
        if writing:
            _WRITES.append(("open", os.fsdecode(args[0])))
    elif event == "os.rename":
        _WRITES.append(("rename", os.fsdecode(args[1])))


def other_filesystem_dir(tmp_path):
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
        return shm
    pytest.skip("no writable directory on another filesystem than the test's")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "tempdir",
    [
        "same_filesystem",
        # Lightning's `_atomic_save` writes through fsspec's transaction: the temporary file lies in the system
        # temp dir and is *moved* into place, a copy when that dir is another filesystem (tmpfs /tmp, checkpoints on
        # NFS/Lustre). A kill during the copy truncates last.ckpt. Fixed by the checkpoint IO proposed for cli.py.
        "other_filesystem",
    ],
)
def test_checkpoints_are_renamed_into_place(chat_target, tmp_path, monkeypatch, tempdir):
    """Every .ckpt the CLI's trainer writes appears by a rename of a complete file, never by writing the file."""
    global _WRITES
    import tempfile

    from spd_lightning import cli

    if tempdir == "other_filesystem":
        other = tempfile.mkdtemp(dir=other_filesystem_dir(tmp_path))
        monkeypatch.setattr(tempfile, "tempdir", other)
    if not getattr(sys, "_spd_audit_installed", False):
        sys.addaudithook(_audit)
        sys._spd_audit_installed = True
    _WRITES = []
    try:
        cli.run_cli(["fit", *resume_fit_args(chat_target, tmp_path, "--trainer.max_steps", "2")])
        writes, _WRITES = _WRITES, None
    finally:
        _WRITES = None
        if tempdir == "other_filesystem":
            import shutil

            shutil.rmtree(other, ignore_errors=True)
    ckpt_dir = str(tmp_path / "ckpt")
    final = [(kind, path) for kind, path in writes if path.startswith(ckpt_dir) and path.endswith(".ckpt")]
    assert ("rename", str(tmp_path / "ckpt" / "last.ckpt")) in final
    assert [path for kind, path in final if kind == "open"] == []


def test_a_checkpoint_the_disk_cannot_hold_is_one_line_and_keeps_the_one_before(tmp_path, monkeypatch):
    """A full disk: torch's zip writer raises a RuntimeError that names no disk ('[enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598', measured on a full 64 KiB tmpfs), which `fit` reported as
    'unexpected RuntimeError (a bug)'. Now one line that names the checkpoint, the reason and the free space; the
    temporary file is removed and the checkpoint written before is kept."""
    from spd_lightning.errors import UserError
    from spd_lightning.training import checkpoint_io
    from spd_lightning.training.checkpoint_io import AtomicCheckpointIO

    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, path)

    def full_disk(obj, f):
        f.write(b"PK" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint_io.torch, "save", full_disk)
    with pytest.raises(UserError, match=r"cannot write checkpoint .*last\.ckpt.* unexpected pos 704 vs 598.* free"):
        AtomicCheckpointIO().save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["last.ckpt"] and torch.load(path, weights_only=True) == {"step": 1}


FULL_DISK_SCRIPT = """
import os, sys, types
import torch
torch.set_num_threads(1)
from spd_lightning import cli
from spd_lightning.training import checkpoint_io

class FullDisk(types.ModuleType):  # `os` for checkpoint_io, whose 5th rename (step 3's first file) finds a full disk
    renames = 0
    def __getattr__(self, name):
        return getattr(os, name)
    def replace(self, src, dst):
        FullDisk.renames += 1
        if FullDisk.renames >= 5:
            raise OSError(28, "No space left on device")
        os.replace(src, dst)

checkpoint_io.os = FullDisk("os")
cli.main(sys.argv[1:])
"""


@pytest.mark.timeout(150)
def test_a_checkpoint_rank_0_cannot_write_ends_every_rank_with_its_line(chat_target, tmp_path):
    """`fit` on 2 ranks (DDP, gloo) whose checkpoint write fails on rank 0, the one that writes (a full disk). Rank 0
    ended with the one line, while rank 1 waited in Lightning's barrier after the write until rank 0's process was gone:
    on gloo it then failed with 'unexpected RuntimeError: ... Connection closed by peer (a bug ...)' (seen), on NCCL it
    hangs until the process group's timeout. Now every rank ends with the line (exit 2), last.ckpt holds step 2."""
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_SCRIPT)
    args = resume_fit_args(chat_target, tmp_path, "--trainer.devices", "2", "--trainer.strategy", "ddp")
    command = [str(script), "fit", *args, "--trainer.max_steps", "8"]
    proc = run_unless_hung(command, 120, "a rank hung after the failed write", {"WANDB_MODE": "disabled"})
    err = proc.stderr
    # each rank's line (both write to one pipe, so the two may run together)
    assert proc.returncode == 2 and err.count("error: ") == 2, err[-3000:]
    assert err.count("error: cannot write checkpoint") == 2 and err.count("No space left on device") == 2, err[-3000:]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 2
