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

from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from kit import make_tiny_model

from spd_lightning.training.module import SPDModule

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest single-threaded

VOCAB, DRAFT_VOCAB, TEACHER_T = 97, 40, 1.7
LENGTHS, T = [12, 9, 5], 12
# Assistant tokens per sequence (the loss mask); the second has a user turn between two assistant turns.
ASSISTANT = [range(4, 12), [2, 3, 4, 5, 8], range(1, 5)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("loss_target"))
    make_tiny_model("qwen3", num_layers=4, vocab_size=VOCAB, seed=3).save_pretrained(path)
    return path


def make_batch() -> dict:
    gen = torch.Generator().manual_seed(11)
    batch = {
        "input_ids": torch.randint(1, VOCAB, (len(LENGTHS), T), generator=gen),  # garbage ids in the padding
        "attention_mask": torch.zeros(len(LENGTHS), T, dtype=torch.long),
        "loss_mask": torch.zeros(len(LENGTHS), T, dtype=torch.bool),
    }
    for b, (length, assistant) in enumerate(zip(LENGTHS, ASSISTANT)):
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
    d2t = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:DRAFT_VOCAB].sort().values
    module._trainer = SimpleNamespace(  # only what training_step and setup read
        datamodule=SimpleNamespace(d2t=d2t),
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(total_batch_idx=0)),
        global_rank=0,
    )
    module.log = lambda *args, **kwargs: None
    module.optimizers = lambda: SimpleNamespace(param_groups=[{"lr": 0.0}])
    module.setup("fit")
    module.configure_model()
    with torch.no_grad():  # a student that is neither the teacher nor uniform
        for p in module.pdm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return module


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
    for b, length in enumerate(LENGTHS):
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
def test_training_loss_is_the_hand_computed_kl(target_dir, aux_weight):
    module = attached_module(target_dir, aux_loss_weight=aux_weight)
    batch = make_batch()
    draws = []
    real_draw = module.layout.draw_fill

    def spy(*args, **kwargs):
        draws.append(real_draw(*args, **kwargs))
        return draws[-1]

    with mock.patch.object(module.layout, "draw_fill", side_effect=spy):
        loss = module.training_step(batch, 0)
    (fill,) = draws
    assert set(fill[:, :T].flatten().tolist()) == {1, 2, 3}  # every fill level occurs in this batch
    expected = hand_loss(module, module.target.model, batch, fill, aux_weight)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert loss.requires_grad
