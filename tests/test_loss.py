"""A known-answer test of the training loss (docs/DESIGN.md, "Loss, optimizer, checkpoints"), computed by hand in numpy.

The loss of one `SPDModule.training_step` on a small padded batch must equal, to float tolerance,

    mean over loss outputs (b, i) of  KL(P || q) = sum_v P(v) (log P(v) - log q(v)),
    P = softmax(z[b, i, d2t] / T_teacher)   (the target's logits for x_{i+1}, restricted to V_d, renormalized),
    q = softmax(student logits of the drafting view of time i)   (untempered),

where output i is a loss output iff x_{i+1} is an assistant token (the label shift) of a real sequence
position (padding and non-assistant tokens carry no loss), plus `aux_loss_weight` times the same mean over
the other active copies. Every ingredient is computed independently of the module: the teacher from the
plain HF forward of each unpadded sequence, the anchor states from HF `hidden_states`, the student from a
plain causal PDM forward over the explicit staircase view (`Geometry.view`), the fill levels from a spy on
the layout's draw. Batch: three sequences of different lengths, one with two assistant turns.
"""

from unittest import mock

import numpy as np
import pytest
import torch
from kit import LOSS_LENGTHS, LOSS_T, TEACHER_T, attached_module, loss_batch

from spd_lightning.training.module import SPDModule


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl(teacher_logits: np.ndarray, student_logits: np.ndarray, d2t: np.ndarray) -> float:
    log_p = log_softmax(teacher_logits[d2t] / TEACHER_T)
    return float((np.exp(log_p) * (log_p - log_softmax(student_logits))).sum())


@torch.no_grad()
def view_outputs(module: SPDModule, states: torch.Tensor, view) -> np.ndarray:
    """Student logits at every position of an explicit (depth, position) sequence, plain causal attention."""
    geometry, pdm = module.geometry, module.pdm
    g = torch.stack([pdm.fuse(states[i], geometry.type_of(depth)) for depth, i in view])[None]
    positions = torch.tensor([[i for _, i in view]])
    return pdm.lm_head(pdm.body(g, positions))[0].double().numpy()


@torch.no_grad()
def hand_loss(module: SPDModule, model, batch: dict, fill: torch.Tensor, aux_weight: float) -> float:
    geometry, n, d2t = module.geometry, module.geometry.n, module.pdm.d2t.numpy()
    main, aux = [], []
    for b, length in enumerate(LOSS_LENGTHS):
        ids = batch["input_ids"][b, :length][None]
        out = model(input_ids=ids, output_hidden_states=True)
        teacher = out.logits[0].double().numpy()  # row i: the target's logits for x_{i+1}
        states = torch.stack([out.hidden_states[a][0] for a in geometry.anchors], dim=1)  # [len, m, H]
        is_label = batch["loss_mask"][b].tolist()
        outputs = {}  # (copy, i) -> student logits of that output
        verified = view_outputs(module, states, [(n, i) for i in range(length)])
        outputs.update({(n, i): verified[i] for i in range(length)})
        for t in range(length + n - 1):  # copy c < n, position i: x_i, the c-th newest token of the view of t = i + c
            a = int(fill[b, t])
            view = [(depth, i) for depth, i in geometry.view(t, a) if i < length]  # causal: newer ones are not read
            rows = view_outputs(module, states, view)
            outputs.update({(c, t - c): rows[t - c] for c in range(a) if 0 <= t - c < length})
        for (c, i), student in sorted(outputs.items()):
            if i + 1 < length and is_label[i + 1]:
                (main if c == 0 else aux).append(kl(teacher[i], student, d2t))
    loss = float(np.mean(main))
    return loss + aux_weight * float(np.mean(aux)) if aux_weight else loss


@pytest.mark.parametrize("aux_weight", [0.0, 0.5])
def test_training_loss_is_the_hand_computed_kl(loss_target_dir, aux_weight):
    module = attached_module(loss_target_dir, aux_loss_weight=aux_weight, fill_probs=None)  # every fill occurs
    batch = loss_batch()
    draws = []
    real_draw = module.layout.draw_fill

    def spy(*args, **kwargs):
        draws.append(real_draw(*args, **kwargs))
        return draws[-1]

    with mock.patch.object(module.layout, "draw_fill", side_effect=spy):
        loss = module.training_step(batch, 0)
    (fill,) = draws
    assert set(fill[:, :LOSS_T].flatten().tolist()) == {1, 2, 3}  # every fill level occurs in this batch
    expected = hand_loss(module, module.target.model, batch, fill, aux_weight)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert loss.requires_grad
