"""The ranks' memory is bounded by configuration, not by what clients send: one runner per rank serves every
sampling setting, so 50 requests with 50 distinct settings leave the ranks' resident memory flat after the
first few (slow)."""

import pytest
from kit import make_tiny_model, save_random_drafter, target_dir

from inference.processes.job import DecodeJob
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry

PROMPT = [(7 * i) % 60 + 3 for i in range(490)]  # near the tiny target's context: caches of ~500 positions
SETTINGS = 50
MB = 1024 * 1024


def rss_bytes(pids) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    return total


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fifty_sampling_settings_leave_the_ranks_memory_flat(tmp_path_factory, tmp_path):
    """A runner per setting would hold ~1.2 MB of caches each here (3 ranks), ~50 MB over these 50 requests; with
    one runner what remains after the 10th request is allocator noise."""
    import time

    from inference.serving.ranks import RankBackend

    path, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    geometry = Geometry.build(target.num_layers, 2)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    job = DecodeJob(
        path,
        geometry,
        [],
        8,
        [],
        target.vocab_size,
        target.hidden_size,
        Sampling(),
        drafter_path=drafter,
        timeout_s=60,
        stream=True,
    )
    backend = RankBackend(job)
    try:
        deadline = time.monotonic() + 120
        while not backend.ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert backend.ready() and len(backend.pids) == 3
        rss = []
        for i in range(SETTINGS):
            sampling = Sampling(temperature=0.5 + 0.01 * i, top_k=i % 7, top_p=1.0 - 0.001 * i)
            result = backend.generate(PROMPT, 8, sampling, i, lambda tokens: None)
            assert result.N == 8
            rss.append(rss_bytes(backend.pids.values()))
        growth = max(rss[10:]) - rss[9]
        assert growth < 10 * MB, [round(r / MB, 1) for r in rss]
    finally:
        backend.close()
