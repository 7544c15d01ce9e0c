"""Every variant of compiled flex a `fit` meets stays under the recompile limit `fit` sets, for both layouts at n = 4.

`fit` makes hitting dynamo's limit an error (`set_recompile_limit`: past it torch would silently run eager flex,
which builds the whole score matrix), so a variant first met at a 9B run's first validation would end it there.
This test drives the module's own steps through compiled flex, as a run does: training with the auxiliary loss
(every copy's rows) and without it (the loss copy's rows, the pruned last layer), a full batch, a short last
batch and a batch of one, one 128-key block and several, validation under `no_grad` and under `inference_mode`
(`validate`), and the staircase evaluation. On the CPU, `aot_eager` stands in for inductor (whose CPU flex
template cannot compile several of these) and torch's refusal of flex's backward on the CPU (a device check in
front of the same math the aot_eager graph runs) is lifted. Slow: a minute of CPU compiles per layout.
"""

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from kit import attached_module, loss_batch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from spd_lightning.training.module import FLEX_RECOMPILE_LIMIT


def batch_of(rows: int, length: int, seed: int) -> dict:
    """`rows` right-padded sequences of `length` tokens at most, the last one shorter."""
    gen = torch.Generator().manual_seed(seed)
    template = loss_batch()
    vocab = int(template["input_ids"].max()) + 1
    lengths = [length] * (rows - 1) + [max(4, length - 7)]
    batch = {
        "input_ids": torch.randint(1, vocab, (rows, length), generator=gen),
        "attention_mask": torch.zeros(rows, length, dtype=torch.long),
        "loss_mask": torch.zeros(rows, length, dtype=torch.bool),
    }
    for b, n in enumerate(lengths):
        batch["attention_mask"][b, :n] = 1
        batch["loss_mask"][b, n // 2 : n] = True
    return batch


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", ["depth", "type"])
def test_every_variant_fit_meets_compiles_under_the_limit(loss_target_dir, aot_eager_flex, layout):
    batches = [loss_batch(), batch_of(2, 40, 1), batch_of(1, 40, 2), batch_of(3, 9, 3)]  # 1 block, 2 blocks, B = 1
    for aux in (0.0, 0.5):  # the loss copy's rows only, then every copy's
        module = attached_module(
            loss_target_dir, layout=layout, n=4, attention_backend="flex_compiled", aux_loss_weight=aux
        )
        for step, batch in enumerate(batches):
            module.training_step(batch, step).backward()
    for mode in (torch.no_grad, torch.inference_mode):
        for step, batch in enumerate(batches):
            with mode():
                module.validation_step(batch, step)
    for seed, batch in enumerate(batches):
        module.staircase_agreement(batch, seed=seed)
    # dynamo's limit counts the graphs of each compiled function (its code object): both stay under it
    graphs = {
        fn.__name__: len(_debug_get_cache_entry_list(fn.__code__))
        for fn in (flex_module.create_block_mask, flex_module.flex_attention)
    }
    assert all(0 < count <= FLEX_RECOMPILE_LIMIT for count in graphs.values()), (graphs, dict(counters["stats"]))
    assert counters["frames"]["ok"] == counters["frames"]["total"]  # no frame fell back to eager
