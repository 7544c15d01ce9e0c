"""The drafter `make demo` decodes with (drafters/smollm2-135m, docs/SMOLLM2.md) loads as the decoder loads it,
belongs to the target the demo links, and stays within the size a committed drafter may take."""

import os
import pathlib

import torch

from spd_lightning.export import load_drafter

DRAFTER = pathlib.Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m"
MAX_BYTES = 20 * 1024 * 1024


def test_the_committed_drafter_loads_for_the_demo_target_and_is_small():
    pdm, spec = load_drafter(str(DRAFTER))
    assert os.path.getsize(DRAFTER / "model.safetensors") <= MAX_BYTES
    assert os.path.basename(spec.target.name_or_path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (spec.target.num_layers, spec.target.hidden_size, spec.target.vocab_size) == (30, 576, 49152)
    assert (spec.geometry.n, spec.pdm.num_layers) == (8, 1)
    assert pdm.d2t.numel() == spec.pdm.draft_vocab_size and int(pdm.d2t.max()) < spec.target.vocab_size
    assert all(torch.isfinite(p).all() for p in pdm.parameters())


def test_its_training_record_names_the_commands_and_the_measured_acceptance():
    record = (DRAFTER / "TRAINING.md").read_text()
    for needed in ("prepare --config configs/smollm2.yaml", "fit --config configs/smollm2.yaml", "export", "alpha"):
        assert needed in record
    assert (DRAFTER / "validation.png").stat().st_size > 0
