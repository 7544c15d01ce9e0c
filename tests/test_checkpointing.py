"""Training-memory fixes: per-layer activation checkpointing, one q/k/v dtype under bf16-mixed on the compiled
flex path, and the teacher restricted to V_d before any fp32 upcast."""

import lightning as L
import torch
from kit import SyntheticChat, make_module, make_trainer
from torch.utils._python_dispatch import TorchDispatchMode

from spd_lightning.pdm import PDMConfig, PipelineDraftModule
from spd_lightning.training.layouts import replication


class GradRecorder(L.Callback):
    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.grads = {k: p.grad.detach().clone() for k, p in module.pdm.named_parameters() if p.grad is not None}


def one_step_grads(target_dir, root, **overrides) -> dict:
    L.seed_everything(0)  # the same PDM initialization in every run
    recorder = GradRecorder()
    trainer = make_trainer(root, max_steps=1, limit_val_batches=0, callbacks=[recorder])
    trainer.fit(make_module(target_dir, num_layers=2, **overrides), SyntheticChat(batch_size=2))
    return recorder.grads


def test_checkpointing_gives_the_plain_gradients(tiny_target_dir, tmp_path):
    plain = one_step_grads(tiny_target_dir, tmp_path / "plain")
    ckpt = one_step_grads(tiny_target_dir, tmp_path / "ckpt", activation_checkpointing=True)
    assert plain.keys() == ckpt.keys() and any(k.startswith("layers.1.") for k in plain)
    for name in plain:  # recomputation runs the same fp32 ops: equal up to summation order
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def saved_bytes(pdm: PipelineDraftModule, checkpointing: bool) -> int:
    g = torch.randn(2, 48, pdm.cfg.hidden_size, requires_grad=True)
    positions = torch.arange(48).expand(2, -1)
    total = [0]

    def pack(t):
        total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pdm.body(g, positions, checkpointing=checkpointing).sum().backward()
    return total[0]


def test_checkpointing_saves_only_layer_inputs():
    cfg = PDMConfig(
        target_hidden_size=64, num_types=1, draft_vocab_size=16, hidden_size=64, num_layers=3, intermediate_size=256
    )
    pdm = PipelineDraftModule(cfg)
    plain, ckpt = saved_bytes(pdm, False), saved_bytes(pdm, True)
    assert ckpt < plain / 4, (ckpt, plain)


class DtypeRecorder:
    """Wraps every attention backend a layout builds and records, per call, the backend and the q, k, v dtypes."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = replication.make_attend

        def wrapped(backend, *args):
            attend = real(backend, *args)

            def recording(layer, q, k, v):
                self.calls.append((backend, q.dtype, k.dtype, v.dtype))
                return attend(layer, q, k, v)

            return recording

        monkeypatch.setattr(replication, "make_attend", wrapped)


def test_bf16_mixed_step_and_compiled_flex_forward(tiny_target_dir, tmp_path, monkeypatch):
    """A bf16-mixed training step, then the same module's forward on COMPILED flex under bf16-mixed (torch has
    no flex backward on CPU, eager or compiled; on CUDA `flex` is compiled for both). q, k, v share bf16."""
    recorder = DtypeRecorder(monkeypatch)
    trainer = make_trainer(tmp_path, max_steps=1, limit_val_batches=1, precision="bf16-mixed")
    # Two heads: torch 2.13's CPU flex template fails to compile (C++ error) at 4 heads with dynamic shapes.
    module = make_module(
        tiny_target_dir, attention_backend="dense", activation_checkpointing=True, num_heads=2, num_kv_heads=2
    )
    data = SyntheticChat(batch_size=2, max_length=24)
    trainer.fit(module, data)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    module.hparams.attention_backend = "flex_compiled"
    metrics = trainer.validate(module, data, verbose=False)[0]
    assert torch.isfinite(torch.tensor(metrics["val/loss"]))
    assert {c[0] for c in recorder.calls} == {"dense", "flex_compiled"}
    assert {c[1:] for c in recorder.calls} == {(torch.bfloat16,) * 3}, set(recorder.calls)


class Float32VocabWatch(TorchDispatchMode):
    """Records every op output that is an fp32 tensor whose last dimension is the full vocabulary."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.hits = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.ndim and out.shape[-1] == self.vocab:
            self.hits.append((str(func), tuple(out.shape)))
        return out


class WatchSteps(L.Callback):
    def __init__(self, vocab: int):
        self.watch = Float32VocabWatch(vocab)

    def on_train_batch_start(self, *args):
        self.watch.__enter__()

    def on_train_batch_end(self, *args):
        self.watch.__exit__(None, None, None)


def test_teacher_is_restricted_before_any_fp32_upcast(tiny_target_dir, tmp_path):
    from kit import TINY_VOCAB

    callback = WatchSteps(TINY_VOCAB)
    trainer = make_trainer(tmp_path, max_steps=2, limit_val_batches=0, callbacks=[callback])
    trainer.fit(make_module(tiny_target_dir, target_dtype="bfloat16"), SyntheticChat(batch_size=2))
    assert trainer.global_step == 2
    assert callback.watch.hits == [], callback.watch.hits
