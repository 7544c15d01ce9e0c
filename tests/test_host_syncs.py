"""The host-sync counter sees each kind of sync, with its call site, and nothing in pure device math."""

import pytest
import torch

from spd_lightning.host_syncs import KINDS, HostSyncCounter

x = torch.randn(6, 4)
mask = x[:, 0] > 0
index = torch.tensor([0, 2, 3])

CASES = {
    "lift_fresh": lambda: torch.tensor([1, 2, 3], device=x.device),
    "scalar_read": lambda: x.sum().item(),
    "scalar_read:bool": lambda: bool(mask.all()),
    "data_dependent_shape": lambda: mask.nonzero(),
    "data_dependent_shape:mask": lambda: x[mask],
    "data_dependent_shape:masked_select": lambda: x.masked_select(mask[:, None]),
    "data_dependent_shape:repeat_interleave": lambda: torch.repeat_interleave(index),
    "to_host": lambda: x.cpu(),
    "to_host:tolist": lambda: x.tolist(),
    "to_host:to_cpu": lambda: x.to("cpu"),
    "to_device": lambda: x.to(x.device),
    "to_device:like": lambda: index.to(x),
    "fresh_index": lambda: x[[0, 2]],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_kind_is_seen_with_its_call_site(case):
    kind = case.split(":")[0]
    with HostSyncCounter(device="cpu") as syncs:
        CASES[case]()
    assert syncs.counts.get(kind, 0) >= 1, syncs.summary()
    assert all(r.site.startswith(__file__) for r in syncs.records), syncs.summary()


def test_every_kind_has_a_case():
    assert {case.split(":")[0] for case in CASES} == set(KINDS)


def test_pure_device_math_is_not_counted():
    w = torch.randn(4, 4, requires_grad=True)
    cached_mask = mask.clone()
    with HostSyncCounter(device="cpu") as syncs:
        y = (x @ w).softmax(-1)
        y = y.masked_fill(~cached_mask[:, None], 0.0)
        picked = y.index_select(0, index) + y[index]  # a cached index tensor is fine
        loss = torch.where(cached_mask, y.logsumexp(-1), 0.0).sum() + picked.sum()
        loss.backward()
        x.to(torch.float16)  # a dtype cast is no move
        torch.zeros(3, device=x.device)  # a factory on the device makes no copy
    assert syncs.total == 0, syncs.summary()


def test_counts_summary_and_reset():
    with HostSyncCounter(device="cpu") as syncs:
        for _ in range(3):
            x.sum().item()
    assert syncs.counts == {"scalar_read": 3}
    assert syncs.summary().startswith("3 host syncs\n  3x scalar_read")
    syncs.reset()
    assert syncs.total == 0


def test_on_a_gpu_model_a_move_to_where_a_tensor_lives_is_free():
    """With a non-CPU device, moves are told by the devices the dispatcher sees: a CPU no-op is free."""
    with HostSyncCounter(device="cuda") as syncs:
        x.to(x.device)
        x.cpu()
    assert syncs.total == 0, syncs.summary()
