"""PDM placement `shared`: the PDM in stage 1's process, n processes for n stages, the same decode."""

import pytest
from conftest import make_tiny_model
from test_inference_support import one_thread, save_random_drafter, target_dir  # noqa: F401 - autouse fixture

from inference.launch import DecodeJob, launch
from inference.simulator import Simulator
from inference.verify import Sampling
from spd_lightning.export import load_drafter
from spd_lightning.geometry import Geometry

pytestmark = pytest.mark.timeout(180)
PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 8]]


@pytest.mark.parametrize(
    "n, mode, sampling",
    [(3, "spd", Sampling()), (2, "spd", Sampling(1.0, 20, 0.9)), (2, "post_step", Sampling())],
    ids=["n3-greedy", "n2-sampled", "n2-post-step"],
)
def test_shared_placement_decodes_what_the_separate_one_and_the_simulator_do(
    tmp_path_factory, tmp_path, n, mode, sampling
):
    path, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    geometry = Geometry.build(target.num_layers, n).with_mode(mode)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))

    def job(placement: str) -> DecodeJob:
        return DecodeJob(
            path,
            geometry.to_dict(),
            PROMPTS,
            16,
            [],
            target.vocab_size,
            target.hidden_size,
            sampling.to_dict(),
            drafter_path=drafter,
            seed=5,
            timeout_s=60,
            pdm_placement=placement,
            profile=True,
        )

    shared_job = job("shared")
    assert shared_job.world_size == n and job("separate").world_size == n + 1
    shared, separate = launch(shared_job), launch(job("separate"))
    simulator = Simulator(target, load_drafter(drafter)[0], geometry, sampling)
    for i, (a, b) in enumerate(zip(shared, separate)):
        simulated = simulator.decode(PROMPTS[i], 16, seed=5 + i)
        assert (a.tokens, a.N, a.K, a.counters) == (b.tokens, b.N, b.K, b.counters)
        assert (a.tokens, a.K) == (simulated.tokens, simulated.K)
        for result in (a, b):  # the cycle profile: every stage's compute and the PDM's draft, per cycle
            per_cycle = result.timing["per_cycle"]
            assert len(per_cycle["wall_s"]) == result.K and all(len(r) == n for r in per_cycle["stage_compute_s"])
            assert result.timing["totals"]["draft_s"] > 0 and result.timing["totals"]["comm_s"] > 0
