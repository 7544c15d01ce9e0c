"""`ChatDataModule`: chat data for online distillation of the drafter (docs/DESIGN.md, "Training data").

    sources --tokenize (cached, per source)--> usable samples --split + mix (seed)--> train / validation
    train --count assistant tokens--> d2t (cached next to the samples)

`prepare_data` (one process per node) builds the caches; `setup` (every process) reads them, building
them itself when run alone. After `setup`: `train_dataset`, `val_dataset`, `d2t` (LongTensor [V_d]),
`stats` (per-source drop counts), and `heldout_prompts(count)` for decoding-based evaluation.

With `states` (a directory written by `prepare --states`, `states.py`) every batch also carries the target's cached
hidden states at `state_layers` (set by the module that reads them), the final-norm state and `outside_vd`, and the
cache is checked against this data (tokenizer, max_length, mixture) in `setup`.

The training loader is resumable (see `resumable.py`): it shuffles by (seed, epoch), shards across the ranks of a
DDP/FSDP run itself, and a run resumed from a mid-epoch checkpoint continues with exactly the batches the
uninterrupted run would have trained next. The position is saved in the checkpoint and read back by Lightning.

The init arguments are plain types and `DataSource` dataclasses, so LightningCLI builds this module from
YAML. `save_hyperparameters` is deliberately not called: checkpoints are read with
`torch.load(weights_only=True)`, which refuses pickled dataclasses; LightningCLI saves the config anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from functools import partial

import datasets
import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from ..errors import UserError
from .chat import check_chat_tokenizer, load_tokenizer
from .collate import ChatCollator
from .formats import DataError
from .mixing import check_val_size, plan_mixture
from .resumable import ResumableDataLoader, ResumableSampler
from .sources import DataSource
from .states import CachedStates, StateCache, StateCollator
from .tokenized import (
    SourceStats,
    TokenizedSource,
    is_tokenized,
    processed_root,
    tokenize_source,
    tokenizer_fingerprint,
)
from .vocab import check_draft_vocab_size, load_or_build_d2t

DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "spd_lightning", "data")


def init_worker(worker_id: int, rank: int) -> None:
    """A loader worker ignores ctrl-C, which a terminal sends it too: the main process stops the run after its step
    (`training/stopping.py`) and ends the workers; a worker that stopped on its own would fail that step's next batch.
    Lightning seeds the worker as it would without a `worker_init_fn` of ours (`seed_everything(workers=True)`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank)


class ChatDataModule(LightningDataModule):
    """Chat conversations rendered with the target's template, assistant-only loss mask, draft vocabulary.

    Args:
        tokenizer: the target's tokenizer (local directory or hub name); its chat template renders the data.
        sources: the mixture; default: the embedded ShareGPT.
        max_length: samples with more tokens are dropped (and counted), never truncated.
        batch_size: samples per batch (per device).
        num_workers: DataLoader worker processes.
        seed: drives the split, the mixture and the shuffling order (epoch e's order is drawn from (seed, e)).
        val_size: validation samples: a count (int) or a fraction of all usable samples (float in (0, 1)).
        draft_vocab_size: `V_d`, clamped to the number of distinct assistant tokens in the training split.
        cache_dir: where tokenized samples and draft vocabularies are cached.
        num_proc: processes for tokenization (None: this process).
        pad_to_multiple_of: round the padded batch length up (e.g. to the attention block size).
        states: a target-state cache written by `prepare --states DIR`: train without running the target.
        trust_remote_code: let transformers run the tokenizer's own code (`fit` links it to the model's).
    """

    def __init__(
        self,
        tokenizer: str,
        sources: list[DataSource] | None = None,
        max_length: int = 2048,
        batch_size: int = 4,
        num_workers: int = 0,
        seed: int = 0,
        val_size: int | float = 0.01,
        draft_vocab_size: int = 32000,
        cache_dir: str = DEFAULT_CACHE_DIR,
        num_proc: int | None = None,
        pad_to_multiple_of: int = 1,
        states: str | None = None,
        trust_remote_code: bool = False,
    ):
        super().__init__()
        check_draft_vocab_size(draft_vocab_size)
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size}: use a positive number of samples per batch")
        check_val_size(val_size)
        self.tokenizer_name = tokenizer
        self.tokenizer = load_tokenizer(tokenizer, trust_remote_code)
        check_chat_tokenizer(self.tokenizer, tokenizer)
        self.sources = [s if isinstance(s, DataSource) else DataSource(**s) for s in (sources or [DataSource()])]
        self.max_length = max_length
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.val_size = val_size
        self.draft_vocab_size = draft_vocab_size
        self.cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
        self.num_proc = num_proc
        self.collate = ChatCollator(self._pad_token_id(), pad_to_multiple_of)
        self.states = states
        self.state_cache: StateCache | None = None  # opened and checked in setup
        self.state_layers: tuple[int, ...] | None = None  # hidden states the batches carry (default: all cached)

        self.train_dataset: datasets.Dataset | None = None
        self.val_dataset: datasets.Dataset | None = None
        self.d2t: torch.Tensor | None = None
        self.stats: list[SourceStats] = []
        self._train_loader: ResumableDataLoader | None = None
        self._resume_position: dict | None = None  # from a checkpoint, for the next train loader
        self._prepare_failed: UserError | None = None  # raised by `setup` (see `prepare_data`)

    def _pad_token_id(self) -> int:
        tokenizer = self.tokenizer
        if tokenizer.pad_token_id is not None:
            return tokenizer.pad_token_id
        if tokenizer.eos_token_id is None:
            raise DataError(
                f"tokenizer {self.tokenizer_name!r} has neither a pad nor an eos token: set `pad_token` "
                f"in its tokenizer_config.json"
            )
        rank_zero_info(
            f"tokenizer {self.tokenizer_name!r} has no pad token: padding with eos "
            f"{tokenizer.eos_token!r} (padding is masked out, so any id works)"
        )
        return tokenizer.eos_token_id

    # -- building ---------------------------------------------------------------------------------
    def _tokenized_sources(self) -> list[TokenizedSource]:
        return [
            tokenize_source(source, self.tokenizer, self.tokenizer_name, self.max_length, self.cache_dir, self.num_proc)
            for source in self.sources
        ]

    def _mixture_key(self) -> str:
        """Changes whenever the split or the mixture can change (given the tokenizer and max_length)."""
        identity = {
            "sources": [[s.fingerprint(), s.weight] for s in self.sources],
            "val_size": self.val_size,
            "seed": self.seed,
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    def _d2t_path(self) -> str:
        root = processed_root(self.cache_dir, self.tokenizer, self.max_length)
        return os.path.join(root, f"d2t-{self._mixture_key()}-{self.draft_vocab_size}.npy")

    def data_identity(self) -> dict:
        """What a state cache records of this data (after `setup`): it serves exactly these samples (with any
        draft vocabulary)."""
        self._require_setup()
        return {
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
            "max_length": self.max_length,
            "mixture": self._mixture_key(),
        }

    def _split(self, parts: list[TokenizedSource]) -> tuple[datasets.Dataset, datasets.Dataset]:
        sizes = [len(p.usable) for p in parts]
        plan = plan_mixture(
            [s.path for s in self.sources], sizes, [s.weight for s in self.sources], self.val_size, self.seed
        )
        rank_zero_info(plan.summary)
        offsets = np.cumsum([0] + [len(p.rows) for p in parts[:-1]])
        rows = datasets.concatenate_datasets([p.rows for p in parts]).remove_columns("status")
        rng = np.random.default_rng(self.seed)

        def gather(per_source: list[np.ndarray]) -> np.ndarray:
            indices = np.concatenate(
                [offset + part.usable[chosen] for offset, part, chosen in zip(offsets, parts, per_source)]
            )
            return rng.permutation(indices)  # interleave the sources

        # indices stay in memory: a mixture must not write files into the shared sample cache
        train = rows.select(gather(plan.train), keep_in_memory=True).remove_columns("prompt")
        return train, rows.select(gather(plan.val), keep_in_memory=True)

    def missing_caches(self) -> list[str]:
        """What `prepare_data` would still build (source paths, `d2t`); empty when a previous run built it all."""
        missing = [s.path for s in self.sources if not is_tokenized(s, self.tokenizer, self.max_length, self.cache_dir)]
        if missing or not os.path.isfile(self._d2t_path()):
            missing.append("d2t")
        return missing

    def prepare_data(self) -> None:
        """Build the caches (Lightning runs this on one process per node before `setup` anywhere). The state it
        sets is exactly what `setup` would set, so this process's `setup` then has nothing left to do. With several
        processes a failure (a source that cannot be read) is raised by `setup`: the other processes wait for this
        one in a barrier, which they left only when it was gone (gloo: 'Connection closed by peer', a bug report;
        NCCL: a hang until the process group's timeout); in `setup` every process reads the data and ends with the
        line."""
        try:
            self._load()
        except UserError as e:
            if self.trainer is None or self.trainer.world_size == 1:
                raise
            self._prepare_failed = e

    def setup(self, stage: str | None = None) -> None:
        failed, self._prepare_failed = self._prepare_failed, None
        if failed is not None:
            raise failed
        self._load()

    def _load(self) -> None:
        if self.train_dataset is not None:
            return
        parts = self._tokenized_sources()
        self.stats = [p.stats for p in parts]
        self.train_dataset, self.val_dataset = self._split(parts)
        self.d2t = load_or_build_d2t(self.train_dataset, len(self.tokenizer), self.draft_vocab_size, self._d2t_path())
        if self.states is not None:
            self.state_cache = StateCache(self.states)
            self.state_cache.check_data(self.data_identity())
            self.state_layers = self.state_layers or self.state_cache.layers

    def _samples(self, dataset: datasets.Dataset, split: str):
        """A split's loader dataset: its token ids and loss mask, plus the cached states when training from them."""
        samples = dataset.select_columns(["input_ids", "loss_mask"])
        if self.state_cache is None:
            return samples
        return CachedStates(samples, self.state_cache, split, self.state_layers, self.d2t)

    # -- loaders ----------------------------------------------------------------------------------
    def _loader_kwargs(self) -> dict:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        return dict(
            batch_size=self.batch_size,
            collate_fn=self.collate if self.state_cache is None else StateCollator(self.collate),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            worker_init_fn=partial(init_worker, rank=rank) if self.num_workers > 0 else None,
        )

    def _require_setup(self) -> None:
        if self.train_dataset is None:
            raise DataError("ChatDataModule is not set up: call `setup()` first (the Trainer does this)")

    def train_dataloader(self) -> ResumableDataLoader:
        """Shuffled by (seed, epoch) and sharded over the trainer's ranks (Lightning keeps this sampler under
        DDP/FSDP); after a resume its first iteration continues the checkpoint's epoch where it stopped."""
        self._require_setup()
        dataset = self._samples(self.train_dataset, "train")
        shard = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        sampler = ResumableSampler(
            dataset, num_replicas=shard.get("num_replicas", 1), rank=shard.get("rank", 0), seed=self.seed
        )
        loader = ResumableDataLoader(dataset, sampler=sampler, **self._loader_kwargs())
        if self.trainer is not None:
            loader.position = self.train_position
            sampler.set_epoch(self.trainer.current_epoch)
        if self._resume_position is not None:
            loader.load_state_dict(self._resume_position)
            self._resume_position = None
        self._train_loader = loader
        return loader

    def train_position(self) -> tuple[int, bool]:
        """The trainer's progress in the train sampler's current epoch: (batches whose training step ran, whether
        the epoch is finished). Read from the trainer, never counted in the loader, which runs a batch ahead."""
        trainer = self.trainer
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return batches, batches >= trainer.num_training_batches

    def state_dict(self) -> dict:
        """The training data position (Lightning saves it in every checkpoint)."""
        return {"train_position": self._train_loader.state_dict()} if self._train_loader is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Lightning calls this when it restores a checkpoint; `train_dataloader` applies the position."""
        trainer = self.trainer
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            return  # `validate --ckpt_path`: no training here, and none to resume in a later `fit`
        self._resume_position = state_dict.get("train_position") or None
        if self._resume_position is not None and trainer is not None and trainer.fit_loop._combined_loader is not None:
            # Strategies that restore after `configure_optimizers` (FSDP, DeepSpeed, ModelParallel) get here after
            # `estimated_stepping_batches` built the train loader (and fetched its first batch) at the epoch's
            # start: drop it, so the fit loop builds it again at the checkpoint's position (Lightning's own tuner
            # forces a reload the same way).
            trainer.fit_loop._combined_loader = None

    def val_dataloader(self) -> DataLoader | list:
        self._require_setup()
        if len(self.val_dataset) == 0:
            return []  # val_size=0: Lightning then skips validation
        return DataLoader(self._samples(self.val_dataset, "val"), **self._loader_kwargs())

    def heldout_prompts(self, count: int) -> list[list[int]]:
        """Token ids of the first user turn of the first `count` validation conversations, rendered with the
        chat template, generation prompt added, thinking disabled: prompts of conversations the drafter never trains on."""
        self._require_setup()
        available = len(self.val_dataset)
        if count > available:
            rank_zero_info(
                f"heldout_prompts: asked for {count} prompts, the validation split has {available} "
                f"(val_size={self.val_size}); returning {available}"
            )
        texts = self.val_dataset.select(range(min(count, available)))["prompt"]
        return [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
