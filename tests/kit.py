"""The test kit: builders every test module shares (tiny random targets, random PDMs, targets and drafters on disk,
a tiny chat tokenizer, the shrunk `fit` arguments, the hand-computed loss's batch, the data-order recorders, a
server process). Nothing here is a test or a fixture: test modules import it (pytest puts tests/ on sys.path),
conftest.py builds its fixtures from it, and no test module imports another (tests/test_architecture.py). What
scripts share with the tests lives in `spd_lightning.testing`."""

import contextlib
import csv
import functools
import glob
import importlib.util
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import lightning as L
import numpy as np
import torch
from scipy.stats import chi2, chisquare
from torch.utils.data import DataLoader

from inference.cycle.result import DecodeResult
from inference.cycle.transport import Arrival, LocalTransport
from inference.sampling import Sampling, warp
from spd_lightning.data import ChatDataModule, DataSource
from spd_lightning.export import DrafterSpec, save_drafter
from spd_lightning.geometry import Geometry
from spd_lightning.pdm import PDMConfig, PipelineDraftModule
from spd_lightning.target import Target
from spd_lightning.testing import fit_args  # noqa: F401 - the tests take it from the kit
from spd_lightning.training.module import SPDModule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_VOCAB = 97
MIN_EXPECTED = 5.0  # a chi-square cell needs at least this expected count (smaller cells are pooled)

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)


def random_pdm(
    target: Target, geometry: Geometry, draft_vocab: int = 48, seed: int = 0, num_layers: int = 2
) -> PipelineDraftModule:
    """A random-init PDM over a random subset of the target vocabulary (so q is zero outside V_d)."""
    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(target.vocab_size, generator=g)[:draft_vocab].sort().values
    torch.manual_seed(seed)
    cfg = PDMConfig(
        target.hidden_size,
        geometry.num_types,
        draft_vocab,
        hidden_size=32,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
    )
    return PipelineDraftModule(cfg, d2t).eval()


def make_tokenizer(vocab_size: int):
    """A WordLevel tokenizer with exactly `vocab_size` ids, a Qwen-style chat template, EOS = the last id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<think>", "</think>"]
    words = ["user", "assistant", "system", "hello", "world", "the", "a", "cat", "sat", "on", "mat"]
    words += [f"w{i}" for i in range(vocab_size - len(specials) - len(words) - 1)]
    vocab = {t: i for i, t in enumerate(specials + words + ["<|im_end|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_target(model, directory: str) -> str:
    """An ordinary HF checkpoint directory (weights + config + tokenizer), like a real target."""
    model.save_pretrained(directory)
    make_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return directory


def save_random_drafter(target: Target, geometry: Geometry, directory: str, seed: int = 0) -> str:
    pdm = random_pdm(target, geometry, seed=seed)
    save_drafter(pdm, DrafterSpec(pdm.cfg, geometry, target.info), directory)
    return directory


def target_with_random_drafter(tmp_path_factory) -> dict:
    """The saved tiny Qwen3.5 and a random n = 2 drafter for it on disk: `{"target": dir, "drafter": dir}`."""
    path, target = target_dir(tmp_path_factory, "qwen3_5", make_tiny_model)
    geometry = Geometry.build(target.num_layers, 2)
    pdm = random_pdm(target, geometry)
    drafter = save_drafter(pdm, DrafterSpec(pdm.cfg, geometry, target.info), str(tmp_path_factory.mktemp("s") / "spd"))
    return {"target": path, "drafter": drafter}


@contextlib.contextmanager
def served(app):
    """`app` served by uvicorn on a free local port in a daemon thread; yields its base URL, stops it after."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10)


def target_dir(tmp_path_factory, arch: str, make_model) -> tuple[str, Target]:
    """Save `make_model(arch)` once per session; returns the directory and the in-memory target."""
    directory = str(tmp_path_factory.mktemp(f"target_{arch}"))
    model = make_model(arch)
    save_target(model, directory)
    return directory, Target(model, directory)


def hf_logits(target: Target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return target.model(torch.tensor([ids])).logits[0]


@functools.cache
def load_script(name: str):
    """`scripts/NAME.py` as a module, once per session: its `main(argv)` then runs in the test's process, without
    the few seconds of CPU a fresh interpreter spends importing torch (the whole-script runs are `slow` tests)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env_without_threads() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def make_tiny_model(arch: str, num_layers: int = 4, vocab_size: int = TINY_VOCAB, hidden_size: int = 32, seed: int = 0):
    """A random-init tiny causal LM of a supported family (qwen3_5 is hybrid linear + full attention)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=vocab_size - 1,
        pad_token_id=0,
    )
    if arch == "qwen3_5":
        cfg = Qwen3_5TextConfig(
            **common,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            full_attention_interval=2,
        )
        model = Qwen3_5ForCausalLM(cfg)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; a larger output scale makes greedy decoding non-trivial.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


# -- the staircase-evaluation callback of configs/tiny.yaml, and what a CSV logger wrote ---------------------
DEMO_PROMPTS = os.path.join(REPO, "docs", "demo_prompts.jsonl")


def callback_args(every: int = 2, **extra) -> list[str]:
    init = {
        "every_n_steps": every,
        "num_prompts": 3,
        "max_new_tokens": 12,
        "prompts": DEMO_PROMPTS,
        "num_batches": 1,
        **extra,
    }
    # configs/tiny.yaml already has the callback: these override its settings.
    return [f"--trainer.callbacks.init_args.{k}={v}" for k, v in init.items()]


def csv_rows(root) -> list[dict]:
    [path] = glob.glob(os.path.join(str(root), "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        return list(csv.DictReader(f))


class SyntheticChat(L.LightningDataModule):
    """Batches in the data contract of spd_lightning.data: right-padded `input_ids`, `attention_mask`, and a
    `loss_mask` on the second half of each sequence (the "assistant" tokens); `d2t` after setup."""

    def __init__(
        self,
        draft_vocab_size: int = 64,
        num_samples: int = 16,
        max_length: int = 20,
        batch_size: int = 4,
        repeat_one: bool = False,
        seed: int = 0,
    ):
        super().__init__()
        self.draft_vocab_size, self.num_samples, self.max_length = draft_vocab_size, num_samples, max_length
        self.batch_size, self.repeat_one, self.seed = batch_size, repeat_one, seed
        self.d2t = None

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        self.d2t = torch.randperm(TINY_VOCAB - 1, generator=gen)[: self.draft_vocab_size].sort().values
        self.samples = []
        for _ in range(self.num_samples):
            n = int(torch.randint(self.max_length // 2, self.max_length + 1, (1,), generator=gen))
            ids = torch.randint(1, TINY_VOCAB - 1, (n,), generator=gen)
            self.samples.append((ids, torch.arange(n) >= n // 2))
        if self.repeat_one:
            self.samples = [self.samples[0]] * self.num_samples

    @staticmethod
    def collate(items):
        T = max(len(ids) for ids, _ in items)
        batch = {
            "input_ids": torch.zeros(len(items), T, dtype=torch.long),
            "attention_mask": torch.zeros(len(items), T, dtype=torch.long),
            "loss_mask": torch.zeros(len(items), T, dtype=torch.bool),
        }
        for b, (ids, loss) in enumerate(items):
            batch["input_ids"][b, : len(ids)] = ids
            batch["attention_mask"][b, : len(ids)] = 1
            batch["loss_mask"][b, : len(ids)] = loss
        return batch

    def train_dataloader(self):
        return DataLoader(self.samples, batch_size=self.batch_size, collate_fn=self.collate)

    def val_dataloader(self):
        return DataLoader(self.samples[:8], batch_size=self.batch_size, collate_fn=self.collate)


def make_module(target_dir: str, **overrides) -> SPDModule:
    args = dict(target=target_dir, target_dtype="float32", n=2, num_layers=1, lr=3e-3, seed=0)
    return SPDModule(**{**args, **overrides})


def make_trainer(root, max_steps: int, **overrides) -> L.Trainer:
    args = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        default_root_dir=str(root),
        enable_checkpointing=False,
        val_check_interval=max_steps,
        check_val_every_n_epoch=None,
    )
    return L.Trainer(**{**args, **overrides})


def random_dist(V, seed, zero_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g) ** 3
    if zero_frac:
        p[torch.rand(V, generator=g) < zero_frac] = 0
    return p / p.sum()


def exact_distributions(target: Target, prompt: list[int], sampling: Sampling):
    """P(t0, t1) and P(t2) of the warped target after `prompt`, from its logits for every prefix (a target whose
    vocabulary is small enough to enumerate every two-token continuation)."""
    V = target.vocab_size
    with torch.no_grad():
        p0 = warp(target.model(torch.tensor([prompt])).logits[0, -1], sampling).double()
        prefixes = torch.tensor([prompt + [a, b] for a, b in itertools.product(range(V), repeat=2)])
        logits = target.model(prefixes).logits
    p1 = warp(logits[::V, -2], sampling).double()  # row a: P(t1 | t0 = a)
    p2 = warp(logits[:, -1], sampling).double().view(V, V, V)  # [a, b]: P(t2 | t0 = a, t1 = b)
    joint01 = p0[:, None] * p1
    return joint01, (joint01[:, :, None] * p2).sum((0, 1))


def merged_chisquare(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value with the cells of expected count < 5 pooled into one (zero cells must stay empty)."""
    assert observed[expected == 0].sum() == 0, "a token of probability 0 was generated"
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    obs, exp = list(observed[big]), list(expected[big])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return chisquare(np.array(obs), exp).pvalue


WORDS = "apple pear plum fig kiwi lime date grape melon peach cherry mango lemon berry olive".split()


def chat_records(count: int, seed: int = 0) -> list[dict]:
    """Distinct short chats, so that every batch gives a different loss."""
    rng = np.random.default_rng(seed)

    def words(k):
        return " ".join(rng.choice(WORDS, k))

    return [
        {
            "conversations": [
                {"from": "human", "value": f"question {i}: {words(3)}?"},
                {"from": "gpt", "value": f"answer {i}: {words(int(rng.integers(3, 12)))}."},
            ]
        }
        for i in range(count)
    ]


def make_data(chat_target, **overrides) -> ChatDataModule:
    args = dict(
        tokenizer=chat_target["target"],
        sources=[DataSource(path=chat_target["data"])],
        val_size=0,
        batch_size=2,
        draft_vocab_size=64,
        cache_dir=chat_target["cache"],
        seed=0,
    )
    return ChatDataModule(**{**args, **overrides})


def pooling(expected: np.ndarray) -> list[np.ndarray]:
    """Groups of cell indices: every cell of expected count >= 5 alone, the rest pooled (zero cells excluded)."""
    order = [i for i in np.argsort(expected) if expected[i] > 0]
    small = [i for i in order if expected[i] < MIN_EXPECTED]
    groups = [np.array([i]) for i in order if expected[i] >= MIN_EXPECTED]
    if small:
        pooled = np.array(small)
        while expected[pooled].sum() < MIN_EXPECTED and groups:
            pooled = np.concatenate([pooled, groups.pop(0)])  # the smallest cell that stands alone
        groups.append(pooled)
    return groups


def chisquare_pvalues(counts: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Pooled Pearson chi-square p-values for rows of `counts` (each row one experiment of the same N)."""
    counts = np.atleast_2d(counts)
    N = counts[0].sum()
    groups = pooling(N * p)
    observed = np.stack([counts[:, g].sum(1) for g in groups], axis=1)
    expected = np.array([N * p[g].sum() for g in groups])
    stat = ((observed - expected) ** 2 / expected).sum(1)
    return chi2.sf(stat, len(groups) - 1)


def forbid_device_sync(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the untimed decode touched torch.cuda.synchronize / Event")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda, "Event", refuse)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- random anchor states and a PDM without a target (the layout tests) ------------------------------------
ANCHOR_HIDDEN, ANCHOR_VOCAB, ANCHOR_BATCH = 24, 50, 3  # the stand-in target's width, V_d, sequences per batch


def anchor_pdm(geometry: Geometry, num_layers: int, seed: int = 0) -> PipelineDraftModule:
    """A random-init PDM fed by random anchor states of width ANCHOR_HIDDEN (no d2t: the layouts need none)."""
    torch.manual_seed(seed)
    cfg = PDMConfig(
        target_hidden_size=ANCHOR_HIDDEN,
        num_types=geometry.num_types,
        draft_vocab_size=ANCHOR_VOCAB,
        hidden_size=32,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
    )
    return PipelineDraftModule(cfg).eval()


def padded_anchor_states(geometry: Geometry, T: int, seed: int):
    """Random anchor states of ANCHOR_BATCH right-padded sequences (lengths T, 2T/3, T/5) with 1e4 garbage in the
    padding; returns the states, the lengths and the generator (for the fill draws)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, T - T // 3, max(2, T // 5)])
    states = torch.randn(ANCHOR_BATCH, T, geometry.num_types, ANCHOR_HIDDEN, generator=gen)
    for b, length in enumerate(lengths.tolist()):
        states[b, length:] = 1e4  # garbage in the padding must not reach any real token
    return states, lengths, gen


# -- the padded batch whose training loss tests/test_loss.py computes by hand ------------------------------
TEACHER_T, LOSS_DRAFT_VOCAB = 1.7, 40
LOSS_LENGTHS, LOSS_T = [12, 9, 5], 12
# Assistant tokens per sequence (the loss mask); the second has a user turn between two assistant turns.
LOSS_ASSISTANT = [range(4, 12), [2, 3, 4, 5, 8], range(1, 5)]


def loss_target(directory: str, num_layers: int = 4) -> str:
    """The tiny Qwen3 (TINY_VOCAB ids, seed 3) the loss batch runs through, saved to `directory`."""
    make_tiny_model("qwen3", num_layers=num_layers, vocab_size=TINY_VOCAB, seed=3).save_pretrained(directory)
    return directory


def loss_batch() -> dict:
    """Three right-padded sequences of LOSS_LENGTHS (garbage ids in the padding), loss mask on LOSS_ASSISTANT."""
    gen = torch.Generator().manual_seed(11)
    batch = {
        "input_ids": torch.randint(1, TINY_VOCAB, (len(LOSS_LENGTHS), LOSS_T), generator=gen),
        "attention_mask": torch.zeros(len(LOSS_LENGTHS), LOSS_T, dtype=torch.long),
        "loss_mask": torch.zeros(len(LOSS_LENGTHS), LOSS_T, dtype=torch.bool),
    }
    for b, (length, assistant) in enumerate(zip(LOSS_LENGTHS, LOSS_ASSISTANT)):
        batch["attention_mask"][b, :length] = 1
        batch["loss_mask"][b, list(assistant)] = True
    return batch


def attach_stub_trainer(module, datamodule) -> None:
    """Give a module only what `setup`, `configure_model` and `training_step` read of a trainer (CPU, rank 0, step
    0), with logging and the optimizer's lr stubbed: a training step can then run without a `Trainer`."""
    module._trainer = SimpleNamespace(
        datamodule=datamodule,
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(total_batch_idx=0)),
        global_rank=0,
    )
    module.log = lambda *args, **kwargs: None
    module.optimizers = lambda: SimpleNamespace(param_groups=[{"lr": 0.0}])


def attached_module(target_dir: str, **overrides) -> SPDModule:
    """An SPDModule set up as a Trainer would (setup, configure_model) with a stand-in trainer and no logging."""
    args = dict(
        target=target_dir,
        target_dtype="float32",
        n=3,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        teacher_temperature=TEACHER_T,
        attention_backend="dense",
        seed=5,
    )
    module = SPDModule(**{**args, **overrides})
    gen = torch.Generator().manual_seed(2)
    d2t = torch.randperm(TINY_VOCAB, generator=gen)[:LOSS_DRAFT_VOCAB].sort().values
    attach_stub_trainer(module, SimpleNamespace(d2t=d2t))
    module.setup("fit")
    module.configure_model()
    with torch.no_grad():  # a student that is neither the teacher nor uniform
        for p in module.pdm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return module


# -- what a run trained on, in order (tests/test_resume.py, also inside its DDP child processes) ------------
NOT_RESUMABLE = "not resumable"


def sample_keys(batch) -> list[tuple]:
    """The samples of a batch, by content (padding removed)."""
    return [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


class Record(L.Callback):
    """Per trained step: its global step, its samples and its loss."""

    def __init__(self):
        self.steps, self.batches, self.losses = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(trainer.global_step)
        self.batches.append(sample_keys(batch))
        self.losses.append(float(outputs["loss"]))


class StopAt(L.Callback):
    """An interruption: the run keeps its length (so its LR schedule) and stops early."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def not_resumable_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if NOT_RESUMABLE in str(w.message)]


class RecordSamples(L.LightningModule):
    """A model that trains on nothing but the data order (fast). Like SPDModule, it may size an LR schedule with
    `estimated_stepping_batches`, which makes Lightning build the train loader inside `configure_optimizers`."""

    def __init__(self, estimate_steps: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.estimate_steps = estimate_steps

    def training_step(self, batch, batch_idx):
        return (self.w - batch["attention_mask"].float().mean()).pow(2).sum()

    def configure_optimizers(self):
        if self.estimate_steps:
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.1)


# -- `python -m inference.serve` as a child process (tests/test_serve.py, tests/test_two_nodes.py) -----------
SERVE_KEY = "sk-test"


class Server:
    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "inference.serve", "--port", str(self.port), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ready(self) -> "Server":
        import httpx

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stderr.read()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("the server did not come up in 90 s")

    def client(self, key: str = SERVE_KEY):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, timeout=60, max_retries=0)

    def post(self, path: str, body, key: str | None = SERVE_KEY, **kw):
        import httpx

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=60, **kw)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(20)


def chat_reply(server: Server, prompt: str, max_tokens: int, stream: bool, model: str = "spd") -> str:
    """A greedy chat completion's text, whole or assembled from its streamed chunks."""
    client = server.client()
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
        return reply.choices[0].message.content
    chunks = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=max_tokens, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks)


def parent_pid(pid) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendant_pids(pid: int) -> list[int]:
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent_pid(p) == pid]
    return children + [d for c in children for d in descendant_pids(c)]


def pid_alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- an accepted drafter (test_lossless_accepted, test_batch_decode) ---------------------------------------------
def nearly_bigram_target(arch: str, context: float) -> Target:
    """A tiny target made nearly a bigram model: its attention and MLP outputs scaled by `context`, so the next
    token depends mostly, not only, on the current one (the drafter below then agrees with it most of the time)."""
    model = make_tiny_model(arch, num_layers=4, seed=1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] in ("o_proj", "out_proj", "down_proj"):
                module.weight.mul_(context)
    return Target(model, f"nearly-bigram-{arch}")


def agreeing_pdm(target: Target, geometry: Geometry, context: float) -> PipelineDraftModule:
    """A PDM that reproduces `nearly_bigram_target`: its type projections pass the embedding anchor through (plus a
    small term from the deeper anchors), its head is the target's LM head, its layers add a small context term."""
    torch.manual_seed(0)
    H = target.hidden_size
    cfg = PDMConfig(
        H,
        geometry.num_types,
        target.vocab_size,
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
    )
    pdm = PipelineDraftModule(cfg).eval()
    with torch.no_grad():
        for proj in pdm.fusion.proj:  # g = RMSNorm(H^0) + a small term from the deeper anchors of its type
            proj.weight.mul_(context)[:, :H] = torch.eye(H)
        for layer in pdm.layers:
            layer.self_attn.o_proj.weight.mul_(context)
            layer.mlp.down_proj.weight.mul_(context)
        pdm.init_head_from_target(target.lm_head.weight)
    return pdm


# -- recorded runs of the decoder (test_hot_path, test_pdm_placement) -------------------------------------------
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


# -- a slow fake decoder and a letter tokenizer behind the server's engine (test_serve_engine, test_serve_operator)
TOKEN_S = 0.05


class Letters:
    """Token i is the letter chr(97 + i % 26); a prompt is its letters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)

    def __call__(self, text):
        return {"input_ids": [ord(c) - 97 for c in text]}


class SlowBackend:
    """`chunk` tokens every TOKEN_S: the prompt's letters, cycled."""

    def __init__(self, chunk: int = 1):
        self.chunk = chunk
        self.generated: list[int] = []  # tokens made per request

    def generate(self, prompt_ids, max_new_tokens, sampling, seed, on_tokens):
        tokens = []
        self.generated.append(0)
        while len(tokens) < max_new_tokens:
            time.sleep(TOKEN_S)
            new = [prompt_ids[i % len(prompt_ids)] for i in range(len(tokens), len(tokens) + self.chunk)]
            tokens += new
            self.generated[-1] += len(new)
            on_tokens(new)
        return DecodeResult(
            mode="ar", n=1, prompt_len=len(prompt_ids), tokens=tokens, K=len(tokens), stop_reason="max_new_tokens"
        )

    def close(self):
        pass
