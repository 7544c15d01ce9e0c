"""The Gated DeltaNet torch fallback: `fit` says so loudly on a GPU, and `estimate` puts its cost in the step time."""

import json
import os

import pytest
import torch
from kit import REPO

from spd_lightning.estimate import main
from spd_lightning.training.deltanet_fallback import FALLBACK_SLOWDOWN, fallback_warning, target_slowdown

FALLBACK = "torch fallback (slow on GPU; missing flash-linear-attention: `pip install .[gpu]`)"


def test_fit_warns_on_cuda_with_the_fallback_only():
    text = fallback_warning(FALLBACK, torch.device("cuda", 0), "Qwen/Qwen3.5-9B")
    assert text.startswith("SLOW: target Qwen/Qwen3.5-9B") and f"about {FALLBACK_SLOWDOWN:.1f}x slower" in text
    assert fallback_warning(FALLBACK, torch.device("cpu"), "t") is None  # the CPU has no fast kernels to miss
    assert fallback_warning("fast kernels (flash-linear-attention, causal-conv1d)", torch.device("cuda"), "t") is None
    assert fallback_warning(None, torch.device("cuda"), "t") is None  # no linear-attention layers


def test_the_target_slows_by_its_share_of_linear_attention_layers():
    assert target_slowdown(24, 8, factor=5.0) == pytest.approx((24 * 5 + 8) / 32)
    assert target_slowdown(0, 36, factor=5.0) == 1.0


def test_estimate_step_time_includes_the_fallback(capsys):
    config = os.path.join(REPO, "configs", "qwen35_9b.yaml")
    runs = {}
    for deltanet in ("fast", "fallback"):
        assert main(["--config", config, "--json", "--deltanet", deltanet]) == 0
        runs[deltanet] = json.loads(capsys.readouterr().out)
    fast, slow = runs["fast"], runs["fallback"]
    assert fast["target_slowdown"] == 1.0 and fast["fallback_factor"] is None
    assert slow["target_slowdown"] == pytest.approx(target_slowdown(24, 8))  # Qwen3.5-9B: 3 of every 4 layers
    extra = (slow["target_slowdown"] - 1) * fast["target_flops_per_token"] * 2 * 2048 / (989e12 * 0.4)
    assert slow["step_s"] - fast["step_s"] == pytest.approx(extra)  # B = 2, T = 2048 in the config
    assert main(["--config", config, "--deltanet", "fallback"]) == 0
    assert "Gated DeltaNet torch fallback makes the target's forward" in capsys.readouterr().out
