"""The compiled decode (`--compile`; inductor on the CPU, CUDA graphs on a GPU): the same greedy tokens, N
and K as eager, and no device synchronization on the untimed path. Compiling is slow on the CPU: small
targets (one layer per stage), few shapes; the simulator's Qwen3 case and the gloo ranks' Qwen3.5 case are slow
(the default suite keeps Qwen3.5 in the simulator and Qwen3 over gloo ranks)."""

import pytest
import torch
from kit import forbid_device_sync, make_tiny_model, random_pdm

from inference.cycle.simulator import Simulator
from inference.sampling import Sampling
from spd_lightning.geometry import Geometry
from spd_lightning.target import Target

PROMPTS = [[3, 14, 15, 92, 65, 35], [7]]


def record_drafts(simulator) -> list[int]:
    """The drafter's proposals, in order (a random PDM is rarely accepted: N and K alone would hide a bad draft)."""
    drafter, proposals = simulator.drafter, []
    draft = drafter.draft

    def recording(views, rows=None):
        drafts = draft(views, rows)
        proposals.extend(int(drafts.tokens[b]) for b in sorted(views))
        return drafts

    drafter.draft = recording
    return proposals


def compare_compiled_with_eager(arch, monkeypatch):
    target = Target(make_tiny_model(arch, num_layers=2), arch)
    geometry = Geometry.build(2, 2)
    pdm = random_pdm(target, geometry, num_layers=1)
    eager = Simulator(target, pdm, geometry)
    compiled = Simulator(target, pdm, geometry, compile=True)
    want_drafts, got_drafts = record_drafts(eager), record_drafts(compiled)
    forbid_device_sync(monkeypatch)
    for prompt in PROMPTS:
        want, got = eager.decode(prompt, 16), compiled.decode(prompt, 16)
        assert (got.tokens, got.N, got.K, got.counters) == (want.tokens, want.N, want.K, want.counters)
        assert got_drafts == want_drafts and len(set(got_drafts)) > 1
        assert 2 <= got.K and got.counters["rejected_by_fill"] != [0, 0]  # rollbacks were exercised
    stage = compiled.stages[1]
    assert (
        stage.compiled
        and stage._step is not stage._decode_step
        and compiled.drafter._step is not compiled.drafter._logits
    )


def test_compiled_qwen35_decode_equals_eager_without_device_sync(monkeypatch):
    compare_compiled_with_eager("qwen3_5", monkeypatch)


@pytest.mark.slow
def test_compiled_qwen3_decode_equals_eager(monkeypatch):
    compare_compiled_with_eager("qwen3", monkeypatch)


def test_the_compile_flag_is_a_decoder_argument():
    from inference.cli import add_decoder_arguments, parser

    p = parser("x", "")
    add_decoder_arguments(p, max_new_tokens=8, with_ar=True)
    assert p.parse_args([]).compile is False
    assert p.parse_args(["--compile"]).compile is True and p.parse_args(["--no-compile"]).compile is False


def test_a_step_that_cannot_be_captured_runs_eagerly(caplog):
    from inference.runtime.capture import CompiledStep

    def host_read(x):  # a host read inside the step: no single graph
        return x * len([v for v in x.tolist() if v > 0])

    step = CompiledStep(host_read, torch.device("cpu"))
    x = torch.tensor([1.0, -2.0, 3.0])
    with caplog.at_level("WARNING", logger="inference"):
        assert torch.equal(step(x), x * 2) and torch.equal(step(x), x * 2)
    assert not step.compiled and step.cuda_graphs is False and "runs eagerly" in caplog.text


def test_a_step_beside_a_captured_one_compiles_without_cuda_graphs(monkeypatch):
    """The shared PDM's draft (`capture=False`) on a GPU: inductor without CUDA graphs, so it never joins the device's
    one graph pool, where its replays on the side stream would run concurrently with stage 1's; reported so."""
    from inference.runtime.capture import SIDE_STREAM, CompiledStep

    compiled, step_begins = [], []
    monkeypatch.setattr(torch, "compile", lambda step, **kw: compiled.append(kw) or step)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: step_begins.append(1))
    gpu = torch.device("cuda", 0)
    stage, draft = CompiledStep(torch.neg, gpu), CompiledStep(torch.neg, gpu, capture=False)
    assert compiled[0]["mode"] == "reduce-overhead"
    assert "mode" not in compiled[1] and compiled[1]["options"] == {"triton.cudagraphs": False}
    x = torch.ones(2)
    assert torch.equal(draft(x), -x) and step_begins == [] and torch.equal(stage(x), -x) and step_begins == [1]
    assert (draft.cuda_graphs, draft.skip_reason) == (False, SIDE_STREAM) and stage.cuda_graphs is True


def growing_prompts(count: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % vocab for j in range(1 + 3 * i)] for i in range(count)]


def backend_of(tmp_path, arch: str, compile: bool):
    """The in-process backend (`inference.backends.make_backend`, what `decode --simulate`, `eval` and the
    server's in-process path run) over a tiny target and a random drafter saved to disk."""
    import argparse

    from kit import save_random_drafter, save_target

    from inference.backends import make_backend
    from inference.setup import prepare

    target = Target(make_tiny_model(arch, num_layers=2), arch)
    geometry = Geometry.build(2, 2)
    target_path = save_target(target.model, str(tmp_path / "target"))
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    args = argparse.Namespace(
        ckpt=drafter, target=target_path, mode=None, device="cpu", dtype="float32", trust_remote_code=False
    )
    setup = prepare(args)
    return make_backend(setup, "cpu", target=target, compile=compile), target


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture
def dynamo_recompile_limit():
    """Dynamo's config is process-wide and its options are not plain module attributes (monkeypatch's undo would
    delete `recompile_limit` for every later test): the test sets it, this puts it back."""
    before = torch._dynamo.config.recompile_limit
    yield
    torch._dynamo.config.recompile_limit = before


def test_the_recompile_limit_falls_back_to_eager_with_one_warning(
    tmp_path, monkeypatch, caplog, dynamo_recompile_limit
):
    """Fast: dynamo's recompile limit lowered to 1 and a capacity bucket of 8 positions, so the second
    prompt's longer caches need more graphs than the limit allows: every compiled step falls back to eager
    with one warning each, the rank lives on, and the tokens are eager's."""
    import inference.runtime.cache
    from inference.runtime.capture import CompiledStep
    from inference.sampling import Sampling

    monkeypatch.setattr(inference.runtime.cache, "CAPACITY_STEP", 8)
    monkeypatch.setattr(CompiledStep, "__init__", limited_compiled_step_init(CompiledStep.__init__, 1))
    torch._dynamo.reset()
    compiled, target = backend_of(tmp_path, "qwen3", compile=True)
    eager, _ = backend_of(tmp_path / "eager", "qwen3", compile=False)
    prompts = [[5, 9, 2], list(range(3, 15))]  # capacities 3 + 6 + 3 -> 16, 12 + 6 + 3 -> 32
    with caplog.at_level("WARNING", logger="inference"):
        for prompt in prompts:
            want = eager.generate(prompt, 6, Sampling(), 0)
            got = compiled.generate(prompt, 6, Sampling(), 0)
            assert (got.tokens, got.N, got.K) == (want.tokens, want.N, want.K)
    runner = compiled.simulator
    steps = [stage._step for stage in runner.stages.values()] + [runner.drafter._step]
    assert not any(step.compiled for step in steps)
    warnings = [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert 1 <= len(warnings) <= len(steps) and "recompile" in caplog.text.lower()


def limited_compiled_step_init(init, limit: int):
    def lowered(self, *args, **kwargs):
        init(
            self, *args, **kwargs
        )  # raises the limit to CompiledStep's floor; lowered after it (`dynamo_recompile_limit`)
        torch._dynamo.config.recompile_limit = limit

    return lowered


@pytest.mark.slow
def test_twenty_growing_prompts_reuse_bucketed_graphs(tmp_path, monkeypatch):
    """20 prompts of growing length (1 to 58 tokens) through the compiled in-process backend: no crash, and
    the caches' power-of-two buckets (16 positions at least here) bound the graphs: per bucket one
    one-token step per stage and one draft per fill level, 2 + 2 on this n = 2 pipeline, and the prompts
    span 4 buckets (16, 32, 64, 128): at most 16 graphs, where an exact capacity per request would need 80."""
    import inference.runtime.cache
    from inference.sampling import Sampling

    monkeypatch.setattr(inference.runtime.cache, "CAPACITY_STEP", 16)
    torch._dynamo.reset()
    compiled, target = backend_of(tmp_path, "qwen3", compile=True)
    before = unique_graphs()
    for prompt in growing_prompts(20, target.vocab_size):
        compiled.generate(prompt, 6, Sampling(), 0)
    runner = compiled.simulator
    steps = [stage._step for stage in runner.stages.values()] + [runner.drafter._step]
    assert all(step.compiled for step in steps)
    assert 0 < unique_graphs() - before <= 16


@pytest.mark.parametrize("placement", ["separate", "shared"])
def test_the_ranks_compile_what_the_job_asks_for(tmp_path, monkeypatch, placement):
    """`DecodeJob.compile` (from `--compile`) reaches every stage's one-token step and the PDM drafter in the rank
    processes, the shared placement's drafter without CUDA graphs. Building a role compiles nothing yet: graphs are
    captured at the first decode step."""
    from kit import save_random_drafter, save_target

    from inference.processes import roles
    from inference.processes.job import DecodeJob
    from inference.runtime.capture import CompiledStep

    drafter_compile = []
    monkeypatch.setattr(
        roles, "PDMDrafter", lambda *a, compile=False, capture=True, **kw: drafter_compile.append((compile, capture))
    )
    monkeypatch.setattr(roles, "PipelineRunner", lambda *a, **kw: None)  # no process group in this test
    monkeypatch.setattr(roles, "DistributedTransport", lambda names: None)
    monkeypatch.setattr(roles, "SharedTransport", lambda n, names: None)
    target = Target(make_tiny_model("qwen3_5", num_layers=2), "tiny")
    geometry = Geometry.build(2, 2)
    target_path = save_target(target.model, str(tmp_path / "target"))
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    drafter_rank = 0 if placement == "shared" else geometry.n
    for compile_ in (False, True):
        job = DecodeJob(
            target_path,
            geometry,
            [[3, 4]],
            4,
            [],
            target.vocab_size,
            target.hidden_size,
            {},
            drafter_path=drafter,
            pdm_placement=placement,
            compile=compile_,
        )
        loaded = roles.load_role(job, 0, torch.device("cpu"))
        assert isinstance(loaded.stages[1]._step, CompiledStep) is compile_
        roles.build_runner(job, drafter_rank, torch.device("cpu"))
        # the shared draft runs beside stage 1's captured step: compiled, never in its CUDA graphs' pool
        assert drafter_compile[-1] == (compile_, placement == "separate")


def compiled_ranks_equal_eager(arch, tmp_path):
    """Gloo rank processes with `DecodeJob.compile` (each rank compiles its own step: the stage ranks their
    one-token step, the PDM rank its draft): the same tokens, N, K and counters as the eager simulator, which
    equals eager ranks (tests/test_inference_distributed.py) and AR."""
    from kit import save_random_drafter, save_target

    from inference.cycle.ar import ar_decode
    from inference.processes.job import DecodeJob
    from inference.processes.launch import launch
    from inference.sampling import Sampling
    from spd_lightning.export import load_drafter

    target = Target(make_tiny_model(arch, num_layers=2), arch)
    geometry = Geometry.build(2, 2)
    target_path = save_target(target.model, str(tmp_path / "target"))
    drafter = save_random_drafter(target, geometry, str(tmp_path / "drafter"))
    job = DecodeJob(
        target_path,
        geometry,
        PROMPTS,
        16,
        [],
        target.vocab_size,
        target.hidden_size,
        Sampling(),
        drafter_path=drafter,
        timeout_s=120,
        compile=True,
    )
    simulator = Simulator(target, load_drafter(drafter)[0], geometry)
    compiled = launch(job)
    for prompt, got in zip(PROMPTS, compiled):
        want = simulator.decode(prompt, 16)
        assert (got.tokens, got.N, got.K, got.counters) == (want.tokens, want.N, want.K, want.counters)
        assert got.tokens == ar_decode(target, prompt, 16).tokens
    assert any(r.counters["rejected_by_fill"] != [0, 0] for r in compiled)  # rollbacks were exercised


@pytest.mark.slow  # fast: test_the_ranks_compile_what_the_job_asks_for (ranks), test_compiled_qwen35_decode_equals_eager
@pytest.mark.timeout(300)
def test_compiled_gloo_ranks_qwen3_equal_eager(tmp_path):
    compiled_ranks_equal_eager("qwen3", tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_gloo_ranks_qwen35_equal_eager(tmp_path):
    compiled_ranks_equal_eager("qwen3_5", tmp_path)


@pytest.mark.parametrize("mode", ["spd", "ar", "eagle3"])
def test_every_in_process_backend_takes_the_compile_flag(tmp_path, monkeypatch, caplog, mode):
    """`serve --simulate --compile` and `serve/decode --mode ar --compile` compile the one-token steps (they ran
    eagerly, silently); chain decoding has no compiled path and says so. Building compiles nothing yet."""
    from kit import save_random_drafter, save_target

    from inference import decode as spd_decode
    from inference.runtime.capture import CompiledStep
    from inference.serving import server
    from spd_lightning.eagle3.export import Eagle3Spec, save_eagle3
    from spd_lightning.eagle3.model import Eagle3Config, Eagle3Drafter

    target = Target(make_tiny_model("qwen3_5", num_layers=2), "tiny")
    target_path = save_target(target.model, str(tmp_path / "target"))
    if mode == "eagle3":
        cfg = Eagle3Config(target.hidden_size, 32, (0, 1, 2), 4, 2, 8, 64)
        drafter = save_eagle3(Eagle3Drafter(cfg, torch.arange(32)), Eagle3Spec(cfg, target.info), str(tmp_path / "d"))
    else:
        drafter = save_random_drafter(target, Geometry.build(2, 2), str(tmp_path / "d"))
    ckpt = "none" if mode == "ar" else drafter
    args = server.parse_args(["--ckpt", ckpt, "--target", target_path, "--mode", mode, "--simulate", "--compile"])
    backend = server.make_backend(server.prepared(args), args)
    stages = {"spd": lambda: backend.runner.stages.values(), "ar": lambda: backend.stages, "eagle3": lambda: []}[mode]()
    assert all(isinstance(stage._step, CompiledStep) for stage in stages)
    assert ("chain decoding (--mode eagle3) has no compiled path" in caplog.text) is (mode == "eagle3")
    if mode == "spd":
        backend.close()
        return
    built, make_backend = [], spd_decode.make_backend  # decode's in-process backends (ar, eagle3) get the flag too
    monkeypatch.setattr(spd_decode, "make_backend", lambda *a, **kw: built.append(kw) or make_backend(*a, **kw))
    args.max_new_tokens = 1  # a prefill: nothing to compile
    assert len(spd_decode._decode(spd_decode.prepare(args), args, [[3, 4]], Sampling())) == 1
    assert built == [{"compile": True}]
