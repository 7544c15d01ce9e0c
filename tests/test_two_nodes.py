"""The distributed decoder on two nodes: two torchrun agents over a c10d rendezvous on 127.0.0.1."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
from conftest import REPO, make_tiny_model
from test_inference_support import one_thread, random_pdm, target_dir  # noqa: F401 - autouse fixture

from inference.decode import main as decode_main
from spd_lightning.export import DrafterSpec, save_drafter
from spd_lightning.geometry import Geometry

pytestmark = pytest.mark.timeout(150)
PROMPT = "hello world"


def test_stages_split_across_two_nodes_decode_what_one_process_does(tmp_path_factory, tmp_path, capsys):
    _, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    geometry = Geometry.build(target.num_layers, 2)  # 3 ranks: 2 on one node, 1 on the other
    pdm = random_pdm(target, geometry)
    drafter = save_drafter(pdm, DrafterSpec(pdm.cfg, geometry, target.info), str(tmp_path / "drafter"))
    args = ["--ckpt", drafter, "--prompt", PROMPT, "--max-new-tokens", "10"]
    assert decode_main([*args, "--simulate"]) == 0
    expected = capsys.readouterr().out.split("\n(N=")[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(procs),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "two-nodes",
                "-m",
                "inference.decode",
                *args,
                "--timeout",
                "60",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for procs in (2, 1)
    ]
    outputs = [agent.communicate(timeout=120) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], [err[-2000:] for _, err in outputs]
    printed = "".join(out for out, _ in outputs)
    assert printed.count("### prompt 1") == 1 and expected in printed
