"""NCCL's rules on the CPU (inference/cycle/nccl_rules.py): the check transport catches what NCCL would hang or
refuse on, the server's control traffic stays off the default group, and a dead peer reads the same under NCCL as
under gloo (inference/runtime/nccl_backend.py)."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from kit import free_port, make_tiny_model, random_pdm, save_random_drafter, target_dir

from inference.cycle import nccl_rules
from inference.cycle.nccl_rules import NcclRuleError, NcclRules
from inference.cycle.simulator import simulate_decode
from inference.cycle.transport import LocalTransport, _peer_error
from inference.runtime.nccl_backend import OBJECT_COLLECTIVES, failure_reason, guard_default_group
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry


def rules(world: int = 2, eager: int = 64) -> NcclRules:
    return NcclRules(LocalTransport(world), eager=eager)


def test_the_test_suite_runs_every_transport_under_the_rules():
    assert nccl_rules.enabled() and isinstance(nccl_rules.checked(LocalTransport(2)), NcclRules)


def test_big_sends_head_to_head_deadlock_and_small_ones_do_not():
    """Both ranks send first and receive second on their one stream: fine while the sends fit NCCL's buffers, a
    deadlock once both wait for their receive."""
    for size, deadlocks in ((8, False), (32, True)):  # 8 or 32 float32 against an eager limit of 64 bytes
        t = rules()
        t.send(0, 1, torch.ones(size), "act")
        t.send(1, 0, torch.ones(size), "anchors1")
        t.recv(0, 1, torch.empty(size), "act")
        t.recv(1, 0, torch.empty(size), "anchors1")
        if deadlocks:
            with pytest.raises(NcclRuleError, match="would deadlock on NCCL: rank 0's send of act to rank 1"):
                t.flush()
        else:
            t.flush()


def test_a_big_send_received_in_order_completes():
    t = rules()
    t.send(0, 1, torch.ones(32), "act_prefill")
    t.recv(0, 1, torch.empty(32), "act_prefill")
    t.send(1, 0, torch.ones(32), "act")
    t.recv(1, 0, torch.empty(32), "act")
    t.flush()


@pytest.mark.parametrize("settled", [False, True])
def test_a_send_that_settle_waited_for_holds_up_the_senders_later_messages(settled):
    """Rank 2 sends rank 0 a big message, then rank 1 a small one; rank 1 passes a message on to rank 0, which takes
    it before the big one. Fine, unless `settle` waited for the big send before the small one went (on a GPU: the
    compute stream waits for it, and every later message queues behind): then it is a cycle across three streams."""
    t = rules(3)
    t.send(2, 0, torch.ones(32), "act_prefill")
    if settled:
        t.settle()
        t.settle()
    t.send(2, 1, torch.ones(2), "draft_token")
    t.recv(2, 1, torch.empty(2), "draft_token")  # rank 1 waits for it before it sends on
    t.send(1, 0, torch.ones(2), "act")
    t.recv(1, 0, torch.empty(2), "act")
    t.recv(2, 0, torch.empty(32), "act_prefill")
    if settled:
        with pytest.raises(NcclRuleError, match="rank 2's send of draft_token to rank 1 .* waits for rank 2's send of"):
            t.flush()
    else:
        t.flush()


def test_data_must_be_contiguous_on_its_device_and_control_in_host_memory():
    t = rules()
    with pytest.raises(NcclRuleError, match="not contiguous"):
        t.send(0, 1, torch.ones(4, 4).t(), "act")
    t.send(0, 1, torch.ones(4), "act")
    with pytest.raises(NcclRuleError, match="rank 0 computes on cpu"):
        t.send(0, 1, torch.ones(4, device="meta"), "act")
    with pytest.raises(NcclRuleError, match="control messages live in host memory"):
        t.send(1, 0, torch.ones(2, dtype=torch.int64, device="meta"), "verdict")


def test_a_receive_of_another_shape_is_refused_even_where_a_copy_would_broadcast():
    t = rules()
    t.send(0, 1, torch.ones(1, 4), "act")
    with pytest.raises(NcclRuleError, match=r"sends act \(1, 4\) torch.float32 to rank 1, which receives act \(2, 4\)"):
        t.recv(0, 1, torch.empty(2, 4), "act")


@pytest.mark.parametrize("eager", [0, nccl_rules.EAGER_BYTES])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_simulator_holds_to_the_rules_with_the_real_shapes_rendezvous(tiny_qwen3, eager, temperature, monkeypatch):
    """The prefill messages and `draft_q` are rendezvous (as at the real shapes) and the decode goes through; with
    every send a rendezvous, the PDM's and stage 1's one-token messages both ways on one stream deadlock, and the
    rules say so: the decoder relies on those staying small."""
    monkeypatch.setenv(nccl_rules.EAGER_ENV, str(eager))
    geometry = Geometry.build(tiny_qwen3.num_layers, 2)
    pdm = random_pdm(tiny_qwen3, geometry)
    prompt, sampling = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], Sampling(temperature=temperature)
    if eager == 0:
        with pytest.raises(NcclRuleError, match="would deadlock on NCCL"):
            simulate_decode(tiny_qwen3, pdm, geometry, prompt, 6, sampling)
    else:
        assert simulate_decode(tiny_qwen3, pdm, geometry, prompt, 6, sampling).N == 6


# -- a dead peer under NCCL reads as under gloo -------------------------------------------------------------------
WATCHDOG = (
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=RECV, NumelIn=1, "
    "NumelOut=1, Timeout(ms)=60000) ran for 60012 milliseconds before timing out."
)
REMOTE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3419, remote process exited or there "
    "was a network error, NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to a network error or a "
    "remote process exiting prematurely.\nLast error:\nsocket recv: Connection reset by peer"
)
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv"


@pytest.mark.parametrize(
    "text,reason",
    [
        (WATCHDOG, "timed out, so it stalled or waits on a stalled rank (NCCL RECV)"),
        (REMOTE, "the peer exited or its connection failed (NCCL)"),
        ("NCCL communicator was aborted on rank 2.", "NCCL aborted the communicator after an error on another rank"),
        (
            "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5",
            "Connection closed by peer [127.0.0.1]:5",
        ),
        (GLOO_TIMEOUT, "timed out, so it stalled or waits on a stalled rank (Timed out waiting 60000ms for recv)"),
    ],
)
def test_nccl_and_gloo_failures_become_the_same_one_line_peer_error(text, reason):
    error = _peer_error("no act from rank 1 (stage 2)", 1, RuntimeError(text))
    assert str(error) == f"no act from rank 1 (stage 2): {reason}" and error.peer == 1
    assert "\n" not in failure_reason(RuntimeError(text))


# -- the server's control traffic ---------------------------------------------------------------------------------
@pytest.fixture
def one_rank_group(monkeypatch):
    for name in OBJECT_COLLECTIVES:  # the guard patches torch.distributed: put it back afterwards
        monkeypatch.setattr(dist, name, getattr(dist, name))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


def test_the_guard_refuses_object_collectives_on_the_default_group(one_rank_group):
    guard_default_group()
    box = ["request"]
    with pytest.raises(NcclRuleError, match="broadcast_object_list on the default group"):
        dist.broadcast_object_list(box, src=0)
    dist.broadcast_object_list(box, src=0, group=nccl_rules.control_group())
    assert box == ["request"]


@pytest.mark.timeout(240)
def test_the_batched_servers_feed_of_every_step_travels_on_the_gloo_group(tmp_path_factory, tmp_path):
    """The ranks run under the guard (`SPD_NCCL_RULES=1` reaches them): a slot feed broadcast on the default group
    (NCCL on GPUs, so a sync of every rank at every step with a free slot) would fail the pipeline here."""
    from inference.processes.job import DecodeJob
    from inference.sampling import Sampling
    from inference.serving.ranks import RankBackend

    assert os.environ[nccl_rules.RULES_ENV] == "1"
    path, target = target_dir(tmp_path_factory, "qwen3", make_tiny_model)
    geometry = Geometry.build(target.num_layers, 2)
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    job = DecodeJob(
        path, geometry, [], 8, [], target.vocab_size, target.hidden_size, Sampling(),
        drafter_path=drafter, timeout_s=60, max_batch=2, stream=True,
    )  # fmt: skip
    backend = RankBackend(job, in_flight=2)
    try:
        result = backend.generate([3, 14, 15, 92], 8, Sampling(), 0, lambda tokens: None)
        assert result.N == 8, backend.failure
    finally:
        backend.close()
