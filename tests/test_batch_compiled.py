"""Compiled batched steps (`--compile` at batch sizes B > 1): one graph per batch bucket, the same tokens as eager.

`Simulator(compile=True)` runs every stage step and the PDM's draft step through `CompiledStep` (inductor on
the CPU). Three requests of different lengths in four slots make the live slots cover buckets 4 (three rows and a
dummy row), 2 and 1 as they end; each bucket is one more graph of the same step. Every sequence's tokens, K and
counters (which depend on every draft) equal the eager batched decode's. A step whose compile fails runs eagerly,
as the batch-1 path's does. Compiling is slow on the CPU: small targets (one layer per stage).
"""

import pytest
from kit import make_tiny_model, random_pdm
from torch._dynamo.exc import Unsupported

from inference.cycle.simulator import Simulator
from inference.cycle.slots import Request
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target

REQUESTS = [
    Request([3, 14, 15, 92, 65, 35], 14),
    Request([7, 7, 8], 9, sampling=Sampling(1.0, top_k=20), seed=4),
    Request([5], 5),
]


def summary(results) -> list[tuple]:
    return [(r.tokens, r.K, r.counters, r.stop_reason) for r in results]


def compiled_steps(simulator: Simulator) -> list:
    return [stage._step for stage in simulator.stages.values()] + [simulator.drafter._step]


def setup(arch: str):
    target = Target(make_tiny_model(arch, num_layers=2), arch)
    geometry = Geometry.build(2, 2)
    return target, geometry, random_pdm(target, geometry, num_layers=1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_compiled_batched_decode_equals_eager_over_every_bucket(arch):
    target, geometry, pdm = setup(arch)
    eager = Simulator(target, pdm, geometry, max_batch=4).run(REQUESTS)
    compiled = Simulator(target, pdm, geometry, max_batch=4, compile=True)
    got = compiled.run(REQUESTS)
    assert summary(got) == summary(eager)
    assert sum(r.counters["rejected_by_fill"][0] for r in got) > 0  # rollbacks per slot were exercised
    assert all(step.compiled for step in compiled_steps(compiled))  # none fell back to eager


def test_a_batched_step_that_fails_to_compile_runs_eagerly(caplog):
    """Every compiled step raises as dynamo does on an untraceable step: each runs eagerly, same tokens."""
    target, geometry, pdm = setup("qwen3")
    eager = Simulator(target, pdm, geometry, max_batch=3).run(REQUESTS)
    compiled = Simulator(target, pdm, geometry, max_batch=3, compile=True)

    def untraceable(*args):
        raise Unsupported("a host read inside the step")

    for step in compiled_steps(compiled):
        step._run = untraceable
    with caplog.at_level("WARNING", logger="inference"):
        got = compiled.run(REQUESTS)
    assert summary(got) == summary(eager)
    assert not any(step.compiled for step in compiled_steps(compiled)) and "runs eagerly" in caplog.text
