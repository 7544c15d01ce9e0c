"""The target's full-vocabulary head runs only where `teacher_top1_outside_vd` is measured: on validation, and
in training every `full_vocab_metric_every_n_steps` steps; otherwise the head computes the `V_d` rows alone."""

import pytest
import torch
from kit import attached_module, loss_batch


class HeadCalls:
    def __init__(self, module):
        self.count = 0
        module.target.model.get_output_embeddings().register_forward_hook(self.hook)

    def hook(self, *_):
        self.count += 1


def logged_keys(module, steps: int) -> list[set]:
    keys = []
    module.log = lambda name, *a, **k: keys[-1].add(name)
    for step in range(steps):
        keys.append(set())
        module._trainer.fit_loop.epoch_loop.total_batch_idx = step
        module.training_step(loss_batch(), step)
    return keys


@pytest.mark.parametrize("every", [0, 2])
def test_training_runs_the_full_head_only_on_the_metric_steps(loss_target_dir, every):
    module = attached_module(loss_target_dir, full_vocab_metric_every_n_steps=every)
    calls = HeadCalls(module)
    keys = logged_keys(module, 4)
    metric_steps = [s for s, k in enumerate(keys) if "train/teacher_top1_outside_vd" in k]
    assert metric_steps == ([] if every == 0 else [0, 2])
    assert calls.count == len(metric_steps)
    assert all("train/agree" in k and "train/loss" in k for k in keys)
    module.validation_step(loss_batch(), 0)
    assert calls.count == len(metric_steps) + 1  # validation measures the metric: the full head runs
    assert torch.isfinite(module.val_metrics.outside.compute())


def test_the_draft_vocabulary_head_gives_the_restricted_teacher(loss_target_dir):
    module = attached_module(loss_target_dir)
    batch, gen = loss_batch(), module._fill_generator(0, 0)
    full = module._forward(batch, gen, full_vocab=True)
    rows = module._forward(batch, module._fill_generator(0, 0), full_vocab=False)
    assert rows.outside_vd is None and full.outside_vd is not None
    torch.testing.assert_close(rows.teacher, full.teacher)
    assert module.target.lm_head.weight.shape[0] == module.target.vocab_size  # the head is restored
