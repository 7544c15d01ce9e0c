"""Training without the command line: a synthetic data module, a ShareGPT-style chat set and its data module, an
SPDModule with small defaults, a quiet CPU Trainer, a stand-in trainer for a step without one, and what a run
trained on, in order (tests/test_resume.py, also inside its DDP child processes): recorders of the steps, samples
and losses, an interruption (`StopAt`, or a signal: `SignalAt`), and a model that trains on nothing but the data
order."""

import os
import signal
from types import SimpleNamespace

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from spd_lightning.data import ChatDataModule, DataSource
from spd_lightning.training.module import SPDModule

from .targets import TINY_VOCAB

NOT_RESUMABLE = "not resumable"
WORDS = "apple pear plum fig kiwi lime date grape melon peach cherry mango lemon berry olive".split()


class SyntheticChat(L.LightningDataModule):
    """Batches in the data contract of spd_lightning.data: right-padded `input_ids`, `attention_mask`, and a
    `loss_mask` on the second half of each sequence (the "assistant" tokens); `d2t` after setup."""

    def __init__(
        self,
        draft_vocab_size: int = 64,
        num_samples: int = 16,
        max_length: int = 20,
        batch_size: int = 4,
        repeat_one: bool = False,
        seed: int = 0,
        vocab_size: int = TINY_VOCAB,  # the target's: token ids and the draft vocabulary are drawn below it
    ):
        super().__init__()
        self.draft_vocab_size, self.num_samples, self.max_length = draft_vocab_size, num_samples, max_length
        self.batch_size, self.repeat_one, self.seed, self.vocab_size = batch_size, repeat_one, seed, vocab_size
        self.d2t = None

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        self.d2t = torch.randperm(self.vocab_size - 1, generator=gen)[: self.draft_vocab_size].sort().values
        self.samples = []
        for _ in range(self.num_samples):
            n = int(torch.randint(self.max_length // 2, self.max_length + 1, (1,), generator=gen))
            ids = torch.randint(1, self.vocab_size - 1, (n,), generator=gen)
            self.samples.append((ids, torch.arange(n) >= n // 2))
        if self.repeat_one:
            self.samples = [self.samples[0]] * self.num_samples

    @staticmethod
    def collate(items):
        T = max(len(ids) for ids, _ in items)
        batch = {
            "input_ids": torch.zeros(len(items), T, dtype=torch.long),
            "attention_mask": torch.zeros(len(items), T, dtype=torch.long),
            "loss_mask": torch.zeros(len(items), T, dtype=torch.bool),
        }
        for b, (ids, loss) in enumerate(items):
            batch["input_ids"][b, : len(ids)] = ids
            batch["attention_mask"][b, : len(ids)] = 1
            batch["loss_mask"][b, : len(ids)] = loss
        return batch

    def train_dataloader(self):
        return DataLoader(self.samples, batch_size=self.batch_size, collate_fn=self.collate)

    def val_dataloader(self):
        return DataLoader(self.samples[:8], batch_size=self.batch_size, collate_fn=self.collate)


def chat_records(count: int, seed: int = 0) -> list[dict]:
    """Distinct short chats, so that every batch gives a different loss."""
    rng = np.random.default_rng(seed)

    def words(k):
        return " ".join(rng.choice(WORDS, k))

    return [
        {
            "conversations": [
                {"from": "human", "value": f"question {i}: {words(3)}?"},
                {"from": "gpt", "value": f"answer {i}: {words(int(rng.integers(3, 12)))}."},
            ]
        }
        for i in range(count)
    ]


def make_data(chat_target, **overrides) -> ChatDataModule:
    """The data module over conftest's `chat_target` (its tokenizer, its jsonl of chats, its cache)."""
    args = dict(
        tokenizer=chat_target["target"],
        sources=[DataSource(path=chat_target["data"])],
        val_size=0,
        batch_size=2,
        draft_vocab_size=64,
        cache_dir=chat_target["cache"],
        seed=0,
    )
    return ChatDataModule(**{**args, **overrides})


def make_module(target_dir: str, **overrides) -> SPDModule:
    args = dict(target=target_dir, target_dtype="float32", n=2, num_layers=1, lr=3e-3, seed=0)
    return SPDModule(**{**args, **overrides})


def make_trainer(root, max_steps: int, **overrides) -> L.Trainer:
    args = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        default_root_dir=str(root),
        enable_checkpointing=False,
        val_check_interval=max_steps,
        check_val_every_n_epoch=None,
    )
    return L.Trainer(**{**args, **overrides})


def quiet_trainer(root, callbacks: list, **overrides) -> L.Trainer:
    """A Lightning trainer with no logger, progress bar, model summary or validation, writing under `root`."""
    args = dict(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(root),
        callbacks=callbacks,
    )
    return L.Trainer(**{**args, **overrides})


def ddp_trainer(root, callbacks: list, **overrides) -> L.Trainer:
    """A quiet Lightning DDP trainer of 2 CPU processes over gloo, for a script that `run_unless_hung` runs."""
    return quiet_trainer(root, callbacks, **{"accelerator": "cpu", "devices": 2, "strategy": "ddp", **overrides})


def how_it_ended(work) -> str:
    """'finished', or 'exit CODE' for the `SystemExit` that ended `work()` (a stop's `SIGTERMException`: None)."""
    try:
        work()
    except SystemExit as e:
        return f"exit {e.code}"
    return "finished"


def attach_stub_trainer(module, datamodule) -> None:
    """Give a module only what `setup`, `configure_model` and `training_step` read of a trainer (CPU, rank 0, step
    0), with logging and the optimizer's lr stubbed: a training step can then run without a `Trainer`."""
    module._trainer = SimpleNamespace(
        datamodule=datamodule,
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(total_batch_idx=0)),
        global_rank=0,
    )
    module.log = lambda *args, **kwargs: None
    module.optimizers = lambda: SimpleNamespace(param_groups=[{"lr": 0.0}])


def sample_keys(batch) -> list[tuple]:
    """The samples of a batch, by content (padding removed)."""
    return [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


class Record(L.Callback):
    """Per trained step: its global step, its samples and its loss."""

    def __init__(self):
        self.steps, self.batches, self.losses = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(trainer.global_step)
        self.batches.append(sample_keys(batch))
        self.losses.append(float(outputs["loss"]))


class SignalAt(L.Callback):
    """Sends this process `signum` (ctrl-C by default) `times` times during step `step`, on rank `rank` only."""

    def __init__(self, step: int, signum: int = signal.SIGINT, times: int = 1, rank: int = 0):
        self.step, self.signum, self.times, self.rank = step, signum, times, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step + 1 == self.step and trainer.global_rank == self.rank:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


class StopAt(L.Callback):
    """An interruption: the run keeps its length (so its LR schedule) and stops early."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def not_resumable_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if NOT_RESUMABLE in str(w.message)]


class RecordSamples(L.LightningModule):
    """A model that trains on nothing but the data order (fast). Like SPDModule, it may size an LR schedule with
    `estimated_stepping_batches`, which makes Lightning build the train loader inside `configure_optimizers`."""

    def __init__(self, estimate_steps: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.estimate_steps = estimate_steps

    def training_step(self, batch, batch_idx):
        return (self.w - batch["attention_mask"].float().mean()).pow(2).sum()

    def configure_optimizers(self):
        if self.estimate_steps:
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.1)
