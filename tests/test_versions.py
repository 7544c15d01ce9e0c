"""The supported releases (spd_lightning/environment/versions.py) and the HF cache adapter (inference/runtime/hf_compat.py).

Whether the decoder really works on the lowest transformers is shown by the tests marked `hf_internals`, which
`make test-min` runs there; these check the pieces: the floors pass here, a release below the floor ends a
command with one `error:` line, and the cache keyword is read off each layer's own signature."""

import os
import subprocess
import sys

import pytest
import torch
from kit import REPO
from torch import nn

from inference.runtime.hf_compat import cache_kwargs, rotary_positions
from spd_lightning.environment.versions import FLOORS, INFERENCE, TRAINING, unsupported
from spd_lightning.errors import TargetError


def test_the_installed_releases_are_supported():
    assert set(INFERENCE) <= set(TRAINING) == set(FLOORS)
    assert [unsupported(p) for p in TRAINING] == [None] * len(TRAINING)


@pytest.mark.hf_internals
@pytest.mark.skipif(not os.environ.get("SPD_BELOW_FLOOR"), reason="`make test-min` provides a release below the floor")
@pytest.mark.parametrize("entry", ["inference.decode", "spd_lightning"])
def test_a_transformers_below_the_floor_is_one_error_line(entry):
    below = os.environ["SPD_BELOW_FLOOR"]  # a transformers release older than the floor, installed --target here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([below, REPO])}
    proc = subprocess.run(
        [sys.executable, "-m", entry, "--help"], env=env, capture_output=True, text=True, timeout=240, cwd=REPO
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: transformers "), proc.stderr[-2000:]
    assert f"needs transformers >= {FLOORS['transformers'].minimum}" in lines[0]


class _NewLayer(nn.Module):  # the signature of a decoder layer from transformers 5.24 on
    def forward(self, hidden_states, position_embeddings=None, cache=None, **kwargs):
        return hidden_states


class _OldLayer(nn.Module):  # ... and before
    def forward(self, hidden_states, position_embeddings=None, past_key_values=None, **kwargs):
        return hidden_states


class _NoCacheLayer(nn.Module):
    def forward(self, hidden_states, **kwargs):
        return hidden_states


def test_the_cache_keyword_is_the_layers_own():
    cache = object()
    assert cache_kwargs(_NewLayer(), cache) == {"cache": cache}
    assert cache_kwargs(_OldLayer(), cache) == {"past_key_values": cache}
    with pytest.raises(TargetError, match="neither `cache` nor `past_key_values`"):
        cache_kwargs(_NoCacheLayer(), cache)


def test_an_mrope_embedding_gets_the_text_positions_on_each_axis():
    positions = torch.tensor([[3, 4, 5]])
    mrope = nn.Module()
    mrope.mrope_section = [2, 1, 1]
    assert rotary_positions(mrope, positions).tolist() == [[[3, 4, 5]]] * 3
    assert rotary_positions(nn.Module(), positions) is positions
