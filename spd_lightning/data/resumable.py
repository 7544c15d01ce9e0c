"""The training loader's position survives a resume (docs/DESIGN.md, "Loss, optimizer, checkpoints"): same order, same shard, same next batch.

Order: epoch `e` visits a permutation of the dataset drawn from `(seed, e)`, padded like `DistributedSampler`
(repeating its start) to a multiple of the number of ranks `R`; rank `r` takes positions `r, r + R, r + 2R, ...`.
After `k` batches of `B` samples on every rank, the ranks together have consumed exactly the first `k * B * R`
positions. That global offset is the whole position: a resumed rank `r` takes `offset + r, offset + r + R, ...`,
which is what the uninterrupted run would have given it.

The position is NOT counted by the loader: Lightning fetches a batch ahead, so when a checkpoint is written the
loader has handed out more batches than were trained. It is read from the trainer's progress when the checkpoint
is written (`ChatDataModule.train_position`: batches whose training step ran in the current epoch).

Lightning restores it through two hooks, both applying the same position (applying it twice is harmless):
- the loader's `state_dict` / `load_state_dict` (Lightning's stateful-loader interface, checkpoint key
  `loops.fit_loop.state_dict.combined_loader`; it also makes the loader "resumable" to Lightning). Lightning
  applies it only when its fit loop builds the loader after restoring the loops;
- the data module's `state_dict` / `load_state_dict` (checkpoint key `ChatDataModule`), restored in every `fit`
  from a checkpoint and applied by `train_dataloader` to the loader it builds next. This covers what the first
  misses: the loader that `estimated_stepping_batches` (SPDModule's LR schedule) builds inside
  `configure_optimizers`, which the fit loop then keeps, and an epoch-based run resumed from an epoch's end
  (its loader is built, and worker processes start filling it, before Lightning sets the new epoch). Strategies
  that restore only after `configure_optimizers` (FSDP, DeepSpeed, ModelParallel) restore it after that early
  loader exists: the data module then drops the loader, and the fit loop builds it again at the position.
"""

from __future__ import annotations

from collections.abc import Callable, Sized

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler

POSITION_VERSION = 1


class ResumableSampler(DistributedSampler):
    """Shuffles by `(seed, epoch)`, shards across `num_replicas` ranks, and can start an epoch at a global offset.

    A `DistributedSampler` subclass, so Lightning keeps it under DDP/FSDP instead of injecting its own.
    `len()` is the full epoch's share of one rank (what Lightning counts batches against); the first iteration
    after `resume_at` yields only the rest of that epoch.
    """

    def __init__(self, dataset: Sized, num_replicas: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True):
        if len(dataset) == 0:
            raise ValueError("ResumableSampler needs a non-empty dataset")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self._resume: tuple[int, int] | None = None  # (epoch, global offset), used by the next iteration only

    def order(self, epoch: int) -> np.ndarray:
        """All ranks' positions of `epoch`: dataset indices, padded to `total_size`."""
        n = len(self.dataset)
        if self.shuffle:
            order = np.random.default_rng([self.seed % 2**63, epoch]).permutation(n)
        else:
            order = np.arange(n)
        return np.concatenate([order, np.resize(order, self.total_size - n)])

    def resume_at(self, epoch: int, offset: int) -> None:
        """Make the next iteration epoch `epoch` from global position `offset` (rounded down to a multiple of the
        number of ranks, so that every rank gets the same number of samples)."""
        offset = min(max(int(offset), 0), self.total_size)
        offset -= offset % self.num_replicas
        self.set_epoch(epoch)
        self._resume = (epoch, offset)

    def __iter__(self):
        offset = 0
        if self._resume is not None:
            epoch, start = self._resume
            self._resume = None
            if epoch == self.epoch:  # otherwise the trainer moved on to another epoch: start that one afresh
                offset = start
        return iter(self.order(self.epoch)[offset + self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(DataLoader):
    """A `DataLoader` over a `ResumableSampler`, with Lightning's stateful-loader interface.

    `position` (set by the data module) returns the trainer's progress in the sampler's current epoch: `(batches
    whose training step ran, whether the trainer considers the epoch finished)`. Without it (no trainer) the
    state is where the sampler will start next.
    """

    position: Callable[[], tuple[int, bool]] | None = None

    def state_dict(self) -> dict:
        sampler = self.sampler
        if not isinstance(sampler, ResumableSampler):  # e.g. Lightning swapped it for `overfit_batches`
            return {}
        if self.position is not None:
            epoch, (batches, finished) = sampler.epoch, self.position()
            if finished or batches >= len(self):
                epoch, batches = epoch + 1, 0
            offset = batches * self.batch_size * sampler.num_replicas
        else:
            epoch, offset = sampler._resume or (sampler.epoch, 0)
        return {
            "version": POSITION_VERSION,
            "epoch": int(epoch),
            "offset": int(offset),
            "seed": int(sampler.seed),
            "dataset_size": len(sampler.dataset),
            "batch_size": int(self.batch_size),
            "num_replicas": int(sampler.num_replicas),
        }

    def load_state_dict(self, state: dict) -> None:
        sampler = self.sampler
        if not state or not isinstance(sampler, ResumableSampler):
            return
        if state.get("version") != POSITION_VERSION:
            rank_zero_warn(
                f"the checkpoint's data position has version {state.get('version')!r}, this build reads "
                f"{POSITION_VERSION}: the resumed epoch starts from its beginning"
            )
            return
        if (state["dataset_size"], state["seed"]) != (len(sampler.dataset), sampler.seed):
            rank_zero_warn(
                f"the training data changed since the checkpoint ({state['dataset_size']} samples, seed "
                f"{state['seed']} -> {len(sampler.dataset)} samples, seed {sampler.seed}): epoch "
                f"{state['epoch']} resumes at position {state['offset']} of the new order, which does not "
                f"skip exactly the samples already trained on"
            )
        elif state["batch_size"] * state["num_replicas"] != self.batch_size * sampler.num_replicas:
            rank_zero_warn(
                f"the global batch changed since the checkpoint ({state['batch_size']} x "
                f"{state['num_replicas']} ranks -> {self.batch_size} x {sampler.num_replicas}): epoch "
                f"{state['epoch']} resumes after the {state['offset']} samples already trained on, "
                f"but its remaining batches no longer match the trainer's batch count"
            )
        sampler.resume_at(state["epoch"], state["offset"])
