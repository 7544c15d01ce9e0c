"""Probes into a decoder run (tests/test_hot_path.py, tests/test_pdm_placement.py, tests/test_compiled_decode.py):
a transport that records every message, a message that arrives late, a ban on device synchronisation, and what a
slot's cache holds (tests/test_slot_state.py, tests/test_eagle3_decode.py)."""

import torch

from inference.cycle.transport import Arrival, LocalTransport


class RecordingTransport(LocalTransport):
    """The simulator's transport, keeping a copy of every message in the order it was sent."""

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.log: list[tuple[int, int, str, torch.Tensor]] = []

    def send(self, src, dst, tensor, kind) -> None:
        super().send(src, dst, tensor, kind)
        self.log.append((src, dst, kind, tensor.clone()))


class LateArrival(Arrival):
    """A message that has not arrived yet when first asked (a verdict later than the next step)."""

    def ready(self) -> bool:
        return False


def forbid_device_sync(monkeypatch):
    """Make torch.cuda.synchronize and torch.cuda.Event raise: a decode that is not timed must touch neither."""

    def refuse(*args, **kwargs):
        raise AssertionError("the untimed decode touched torch.cuda.synchronize / Event")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda, "Event", refuse)


def check_batched_timing(prompts: list[dict], n: int, max_batch: int) -> None:
    """Each prompt's `--profile` timing (report entries, or `DecodeResult.to_dict()`s) of one batched run: a row
    per cycle of the runner while it decoded (`timing["cycles"]`), each with every stage's compute and the slots
    that ran a real cycle in it. Prompts decoded side by side share their rows, and over the run each slot's real
    cycles add up to the prompts' K: so every row is counted where it belongs."""
    runs: dict[int, tuple] = {}  # the runner's cycle -> its row, as every prompt that shared it saw it
    for p in prompts:
        first, end = p["timing"]["cycles"]
        per_cycle = p["timing"]["per_cycle"]
        assert len(per_cycle["wall_s"]) == end - first >= p["K"] and all(
            len(r) == n for r in per_cycle["stage_compute_s"]
        )
        assert all(1 <= slots <= max_batch for slots in per_cycle["slots"])
        assert p["timing"]["totals"]["draft_s"] > 0 and p["timing"]["totals"]["wall_s"] > 0
        for i, cycle in enumerate(range(first, end)):
            row = (per_cycle["slots"][i], per_cycle["wall_s"][i], tuple(per_cycle["stage_compute_s"][i]))
            assert runs.setdefault(cycle, row) == row
    assert sorted(runs) == list(range(1, len(runs) + 1))  # the prompts' rows cover the run's cycles
    assert sum(row[0] for row in runs.values()) == sum(p["K"] for p in prompts)
    assert max(row[0] for row in runs.values()) == max_batch  # some cycle ran every slot


def slot_state(cache, slot: int) -> list[torch.Tensor]:
    """What slot `slot` of a `StageCache` holds: the keys and values of its positions (the storage's tail past them is
    stale, masked, and overwritten by the next forward), its conv and recurrent states; copies."""
    out, held = [], cache.lengths[slot]
    for i in cache.attention_layers:
        out += [cache.keys[i][slot, :, :held].clone(), cache.values[i][slot, :, :held].clone()]
    for i in cache.linear_layers:
        out += [cache.conv[i][slot].clone(), cache.recurrent[i][slot].clone()]
    return out


def assert_same_state(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Two `slot_state`s bit for bit."""
    assert len(got) == len(want) > 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and torch.equal(a, b), f"state tensor {i} differs by {(a - b).abs().max()}"
