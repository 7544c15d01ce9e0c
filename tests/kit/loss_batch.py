"""The padded batch whose training loss tests/test_loss.py computes by hand, the tiny target it runs through, and
an SPDModule set up to train on it without a Trainer."""

from types import SimpleNamespace

import torch

from spd_lightning.training.module import SPDModule

from .targets import TINY_VOCAB, make_tiny_model
from .training import attach_stub_trainer

TEACHER_T, LOSS_DRAFT_VOCAB = 1.7, 40
LOSS_LENGTHS, LOSS_T = [12, 9, 5], 12
# Assistant tokens per sequence (the loss mask); the second has a user turn between two assistant turns.
LOSS_ASSISTANT = [range(4, 12), [2, 3, 4, 5, 8], range(1, 5)]


def loss_target(directory: str, num_layers: int = 4) -> str:
    """The tiny Qwen3 (TINY_VOCAB ids, seed 3) the loss batch runs through, saved to `directory`."""
    make_tiny_model("qwen3", num_layers=num_layers, vocab_size=TINY_VOCAB, seed=3).save_pretrained(directory)
    return directory


def loss_batch() -> dict:
    """Three right-padded sequences of LOSS_LENGTHS (garbage ids in the padding), loss mask on LOSS_ASSISTANT."""
    gen = torch.Generator().manual_seed(11)
    batch = {
        "input_ids": torch.randint(1, TINY_VOCAB, (len(LOSS_LENGTHS), LOSS_T), generator=gen),
        "attention_mask": torch.zeros(len(LOSS_LENGTHS), LOSS_T, dtype=torch.long),
        "loss_mask": torch.zeros(len(LOSS_LENGTHS), LOSS_T, dtype=torch.bool),
    }
    for b, (length, assistant) in enumerate(zip(LOSS_LENGTHS, LOSS_ASSISTANT)):
        batch["attention_mask"][b, :length] = 1
        batch["loss_mask"][b, list(assistant)] = True
    return batch


def attached_module(target_dir: str, **overrides) -> SPDModule:
    """An SPDModule set up as a Trainer would (setup, configure_model) with a stand-in trainer and no logging."""
    args = dict(
        target=target_dir,
        target_dtype="float32",
        n=3,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        teacher_temperature=TEACHER_T,
        attention_backend="dense",
        seed=5,
    )
    module = SPDModule(**{**args, **overrides})
    gen = torch.Generator().manual_seed(2)
    d2t = torch.randperm(TINY_VOCAB, generator=gen)[:LOSS_DRAFT_VOCAB].sort().values
    attach_stub_trainer(module, SimpleNamespace(d2t=d2t))
    module.setup("fit")
    module.configure_model()
    with torch.no_grad():  # a student that is neither the teacher nor uniform
        for p in module.pdm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return module
