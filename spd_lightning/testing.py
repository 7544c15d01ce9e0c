"""Random stand-ins that the tests (tests/kit/) and the scripts (scripts/) share: `fit`'s arguments for
configs/tiny.yaml (and tiny_eagle3.yaml) shrunk to seconds, a random-init PDM shaped like its target, and
full-length random chat batches. Training and decoding never import this module."""

from __future__ import annotations

import os

import lightning as L
import torch

from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PDMConfig, PipelineDraftModule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fit_args(target: str, root, *extra: str) -> list[str]:
    """configs/tiny.yaml shrunk to seconds: 2 stages, 100 ShareGPT chats, batches of 2, no logger, everything under
    `root` (data cache, checkpoints; a str or a path)."""
    root = os.fspath(root)
    return [
        "--config",
        os.path.join(REPO, "configs", "tiny.yaml"),
        "--model.target",
        target,
        "--model.n",
        "2",
        "--data.sources",
        "[{path: sharegpt, max_samples: 100}]",
        "--data.max_length",
        "1024",
        "--data.draft_vocab_size",
        "256",
        "--data.batch_size",
        "2",
        "--data.val_size",
        "4",
        "--data.cache_dir",
        os.path.join(root, "cache"),
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.default_root_dir",
        root,
        "--checkpoint.dirpath",
        os.path.join(root, "ckpt"),
        *extra,
    ]


def eagle3_fit_args(target: str, root, *extra: str) -> list[str]:
    """`fit_args` on configs/tiny_eagle3.yaml (its model section is the EAGLE-3 drafter's): 2 TTT steps, 2 steps."""
    args = fit_args(target, root, "--model.ttt_steps", "2", "--trainer.max_steps", "2", *extra)
    args[args.index("--config") + 1] = os.path.join(REPO, "configs", "tiny_eagle3.yaml")
    i = args.index("--model.n")
    return args[:i] + args[i + 2 :]


def target_shaped_pdm(
    config,
    geometry: Geometry,
    num_layers: int,
    d2t: torch.Tensor | None = None,
    draft_vocab: int | None = None,
    device=None,
    dtype: torch.dtype | None = None,
) -> PipelineDraftModule:
    """A random-init PDM of the target's width, heads and MLP (`config`: the target's transformers config; what a
    trained drafter of this target costs), over `d2t` (or the first `draft_vocab` ids when no `d2t` is given), in
    eval mode on `device` in `dtype`. Seed the global RNG first for fixed weights."""
    cfg = PDMConfig(
        target_hidden_size=config.hidden_size,
        num_types=geometry.num_types,
        draft_vocab_size=len(d2t) if d2t is not None else draft_vocab,
        hidden_size=config.hidden_size,
        num_layers=num_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
    )
    return PipelineDraftModule(cfg, d2t).to(device=device, dtype=dtype).eval()


class RandomChats(L.LightningDataModule):
    """`steps` full-length random batches (no padding) with a loss mask from `loss_from * length` on; `d2t` = the
    first V_d ids. The items of its loader are whole batches."""

    def __init__(self, vocab: int, length: int, batch: int, steps: int, draft_vocab: int, loss_from: float = 0.5):
        super().__init__()
        self.vocab, self.length, self.batch, self.steps = vocab, length, batch, steps
        self.loss_from = loss_from
        self.d2t = torch.arange(draft_vocab)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(self.steps):
            ids = torch.randint(0, self.vocab, (self.batch, self.length), generator=gen)
            loss = (torch.arange(self.length) >= int(self.length * self.loss_from)).expand(self.batch, -1)
            batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss.clone()})
        return torch.utils.data.DataLoader(batches, batch_size=None)
