"""Builders shared by the inference tests: random PDMs, targets and drafters on disk, a tiny chat tokenizer.

Nothing here is a test; the inference test modules import it (pytest puts tests/ on sys.path).
"""

import os

import pytest
import torch

from spd_lightning.export import DrafterSpec, save_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PDMConfig, PipelineDraftModule
from spd_lightning.target import Target

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine run ~10x faster single-threaded (no OpenMP spinning)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_pdm(
    target: Target, geometry: Geometry, draft_vocab: int = 48, seed: int = 0, num_layers: int = 2
) -> PipelineDraftModule:
    """A random-init PDM over a random subset of the target vocabulary (so q is zero outside V_d)."""
    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(target.vocab_size, generator=g)[:draft_vocab].sort().values
    torch.manual_seed(seed)
    cfg = PDMConfig(
        target.hidden_size,
        geometry.num_types,
        draft_vocab,
        hidden_size=32,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
    )
    return PipelineDraftModule(cfg, d2t).eval()


def make_tokenizer(vocab_size: int):
    """A WordLevel tokenizer with exactly `vocab_size` ids, a Qwen-style chat template, EOS = the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<think>", "</think>"]
    words = ["user", "assistant", "system", "hello", "world", "the", "a", "cat", "sat", "on", "mat"]
    words += [f"w{i}" for i in range(vocab_size - len(specials) - len(words) - 1)]
    vocab = {t: i for i, t in enumerate(specials + words + ["<|im_end|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_target(model, directory: str) -> str:
    """An ordinary HF checkpoint directory (weights + config + tokenizer), like a real target."""
    model.save_pretrained(directory)
    make_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return directory


def save_random_drafter(target: Target, geometry: Geometry, directory: str, seed: int = 0) -> str:
    pdm = random_pdm(target, geometry, seed=seed)
    save_drafter(pdm, DrafterSpec(pdm.cfg, geometry, target.info), directory)
    return directory


def target_dir(tmp_path_factory, arch: str, make_model) -> tuple[str, Target]:
    """Save `make_model(arch)` once per session; returns the directory and the in-memory target."""
    directory = str(tmp_path_factory.mktemp(f"target_{arch}"))
    model = make_model(arch)
    save_target(model, directory)
    return directory, Target(model, directory)


def hf_logits(target: Target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return target.model(torch.tensor([ids])).logits[0]


def env_without_threads() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env
