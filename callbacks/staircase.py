"""Staircase evaluation: what a user watches while a drafter trains (docs/DESIGN.md, "Staircase evaluation").

Every `every_n_steps` optimizer steps, at the end of `fit`, and in `validate`, the callback decodes a
held-out prompt set with the single-process simulator (`inference.cycle.simulator`, the same scheduler the
pipeline ranks run) and the PDM as it is now, and reports

    staircase/alpha              N / K over all prompts (step acceptance)
    staircase/speedup            n * alpha (the theoretical speedup, free drafter and links), measured
    staircase/predicted_n_alpha  n * alpha as the refill chain predicts it (spd_lightning/fill_chain.py) from the
                                 teacher-forced acceptance per fill of the agreement batches: a gap between the
                                 two says validation does not predict decoding
    staircase/accept_fill{a}     acceptance rate of drafts made at fill level a
    staircase/accept_depth{k}    acceptance rate by drafting depth
    staircase/mean_accept_run    accepted drafts per rejection (+1): the mean run of consecutive accepts
    staircase/agree_d{k}_f{a}    teacher-forced top-1 agreement of the copy at depth k under fill a,
                                 from up to `num_batches` validation batches (the layout's own views)

With `method: walk` (T = 0) the decodes are replaced by walks of the PDM's teacher-forced drafts over each
prompt's greedy answer, computed once: the same numbers, exactly, where the layout's views are exact.

Scalars go to every logger (W&B, CSV, ...) at the global step and into `trainer.callback_metrics`, so a
`ModelCheckpoint(monitor="staircase/alpha", mode="max")` keeps the best drafter. With a W&B logger it also
logs a per-prompt table and the depth x fill heatmap; PNGs of the heatmap and of alpha vs step are
written under the run's log directory for any logger. Under DDP each rank decodes a shard of the prompts
and the counts are summed, so the numbers equal a one-process evaluation. When the drafter trains from a state
cache (`--data.states`), the target is loaded for each evaluation's decodes and freed after them
(`SPDModule.evaluation_target`); the agreement batches read the cache like training.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from inference.cycle.ar import ar_decode, target_eos
from inference.cycle.simulator import Simulator
from inference.prompts import read_prompts
from inference.sampling import Sampling
from spd_lightning.data.chat import render_prompt
from spd_lightning.data.collate import answer_batch
from spd_lightning.errors import ConfigError
from spd_lightning.fill_chain import measured_prediction, walked_counts, walked_cycles
from spd_lightning.training.metrics import GroupedAgreement

from .plots import alpha_curve_png, heatmap_png


class StaircaseEvaluation(L.Callback):
    """Decodes held-out prompts with the simulator and the PDM as it is now, and logs the staircase metrics.

    Args:
        every_n_steps: evaluate after every this many optimizer steps (0: only at the end of fit / validate).
        num_prompts: prompts decoded per evaluation.
        max_new_tokens: tokens generated per prompt.
        prompts: an EAGLE-style jsonl of prompts; default: the data module's held-out conversations.
        num_batches: validation batches for the teacher-forced depth x fill agreement (0 skips it).
        temperature: sampling temperature (0: greedy).
        top_k: sample from the k most likely tokens (0: all).
        top_p: sample from the smallest set of tokens whose probability reaches p (1: all).
        seed: seeds the sampling and offsets the fill levels of the agreement batches (every level in turn).
        log_table: log the per-prompt table to W&B.
        method: `decode` runs the simulator. `walk` (temperature 0 only) decodes each prompt once with the target
            alone (its greedy answer is what any lossless decode outputs), then at every evaluation walks the PDM's
            teacher-forced drafts at every fill over it as the decoder would (`fill_chain.walk`): the decoder's
            `N`, `K` and counters exactly where the layout's views are exact (`depth`; `type` at `num_layers: 1`),
            one forward per fill instead of a decode per prompt, so more prompts for the same time.
    """

    def __init__(
        self,
        every_n_steps: int = 200,
        num_prompts: int = 8,
        max_new_tokens: int = 64,
        prompts: str | None = None,
        num_batches: int = 2,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        log_table: bool = True,
        method: Literal["decode", "walk"] = "decode",
    ):
        if every_n_steps < 0 or num_prompts < 1 or max_new_tokens < 1 or num_batches < 0:
            raise ConfigError(
                f"StaircaseEvaluation: every_n_steps={every_n_steps} must be >= 0, num_prompts="
                f"{num_prompts} and max_new_tokens={max_new_tokens} >= 1, num_batches={num_batches} >= 0"
            )
        self.every_n_steps, self.num_prompts, self.max_new_tokens = every_n_steps, num_prompts, max_new_tokens
        self.prompt_file, self.num_batches, self.log_table, self.seed = prompts, num_batches, log_table, seed
        self.sampling = Sampling(temperature, top_k, top_p)
        if method not in ("decode", "walk") or (method == "walk" and temperature != 0):
            raise ConfigError(
                f"StaircaseEvaluation: method={method!r} with temperature={temperature}: use decode, or walk at "
                "temperature 0 (a sampled decode's answer depends on its drafts)"
            )
        self.method = method
        self._answers: dict[int, list[int]] = {}  # `walk`: the target's greedy answer of each prompt, by index
        self.history: list[tuple[int, float]] = []  # (global step, alpha): the alpha-vs-step curve
        self._prompt_ids: list[list[int]] | None = None

    # -- when ------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        """Reads the prompts as the run starts (the data module is set up, no step has run): a prompts file that
        cannot be read, or no held-out conversation, stops it with one line here, not `every_n_steps` into it; so is
        `walk` on a layout whose views are not exact."""
        self.prompts(trainer)
        hp = pl_module.hparams
        if self.method == "walk" and hp.get("layout") == "type" and hp.get("num_layers", 1) > 1:
            raise ConfigError(
                f"StaircaseEvaluation: method=walk needs exact training views; the type layout at num_layers="
                f"{hp['num_layers']} approximates them: use method: decode, or the depth layout"
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and self._last_step() != step:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._last_step() != trainer.global_step:
            self.evaluate(trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            self.evaluate(trainer, pl_module)

    def _last_step(self) -> int | None:
        return self.history[-1][0] if self.history else None

    # -- what ------------------------------------------------------------------------------------
    def prompts(self, trainer) -> list[list[int]]:
        if self._prompt_ids is None:
            dm = trainer.datamodule
            if self.prompt_file:
                texts = read_prompts(None, self.prompt_file)[: self.num_prompts]
                self._prompt_ids = [render_prompt(dm.tokenizer, t) for t in texts]
            else:
                self._prompt_ids = [list(p) for p in dm.heldout_prompts(self.num_prompts)]
            if not self._prompt_ids:
                raise ConfigError("staircase evaluation found no held-out prompt: give `prompts:` a jsonl file")
        return self._prompt_ids

    @torch.no_grad()
    def evaluate(self, trainer, pl_module) -> dict[str, float]:
        was_training = pl_module.pdm.training
        pl_module.pdm.eval()
        try:
            with pl_module.evaluation_pdm() as pdm:  # under FSDP: a plain copy of the gathered parameters
                with pl_module.evaluation_target() as target:  # from a state cache: loaded now, freed after
                    measure = self._walk if self.method == "walk" else self._decode
                    decoded, rows = measure(trainer, pl_module, pdm, target)
                agreement, accepted = self._agreement(trainer, pl_module, pdm) if self.num_batches else (None, {})
        finally:
            pl_module.pdm.train(was_training)
        metrics = self._metrics(decoded, agreement, pl_module.geometry.n)
        predicted = measured_prediction(accepted, pl_module.geometry.n)
        if predicted is not None:
            metrics["staircase/predicted_n_alpha"] = predicted[1]
        step = trainer.global_step
        self.history.append((step, metrics["staircase/alpha"]))
        trainer.callback_metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()})
        # Trainer.log_dir is a collective (it broadcasts from rank 0): read it on every rank, log on rank 0.
        self._log(
            trainer, os.path.join(trainer.log_dir or trainer.default_root_dir, "staircase"), metrics, rows, agreement
        )
        return metrics

    def _decode(self, trainer, pl_module, pdm, target) -> tuple[torch.Tensor, list[list[Any]]]:
        """Decode this rank's shard of the prompts; returns the summed counters (all ranks) and table rows."""
        n, world, rank = pl_module.geometry.n, trainer.world_size, trainer.global_rank
        sim = Simulator(target, pdm, pl_module.geometry, self.sampling)
        eos = target_eos(target.config, getattr(target.model, "generation_config", None))
        tok = getattr(trainer.datamodule, "tokenizer", None)

        counts = _empty_counts(n)
        rows = []
        for i, ids in enumerate(self.prompts(trainer)):
            if i % world != rank:
                continue
            r = sim.decode(ids, self.max_new_tokens, eos, seed=self.seed + i)
            c = r.counters
            counts += torch.tensor(
                [
                    r.N,
                    r.K,
                    *c["accepted_by_fill"],
                    *c["rejected_by_fill"],
                    *c["accepted_by_depth"],
                    *c["rejected_by_depth"],
                ],
                dtype=torch.float64,
            )
            rows.append([i, _text(tok, ids), _text(tok, r.tokens), r.N, r.K, r.alpha])
        return self._sum(trainer, counts), self._gather(trainer, rows)

    def _walk(self, trainer, pl_module, pdm, target) -> tuple[torch.Tensor, list[list[Any]]]:
        """`_decode`'s counters and rows without a decode: each prompt's greedy answer (the target's, computed once)
        and the PDM's teacher-forced drafts at every fill over it, walked as the decoder walks them."""
        world, rank = trainer.world_size, trainer.global_rank
        eos = target_eos(target.config, getattr(target.model, "generation_config", None))
        tok = getattr(trainer.datamodule, "tokenizer", None)
        counts, rows = _empty_counts(pl_module.geometry.n), []
        for i, ids in enumerate(self.prompts(trainer)):
            if i % world != rank:
                continue
            if i not in self._answers:
                self._answers[i] = ar_decode(target, ids, self.max_new_tokens, eos_token_id=eos).tokens
            answer = self._answers[i]
            walked = walked_decode(pl_module, pdm, target, ids, answer)
            counts += walked
            N, K = int(walked[0]), int(walked[1])
            rows.append([i, _text(tok, ids), _text(tok, answer), N, K, N / K if K else None])
        return self._sum(trainer, counts), self._gather(trainer, rows)

    def _agreement(self, trainer, pl_module, pdm) -> tuple[torch.Tensor, dict[int, float]]:
        """Teacher-forced top-1 agreement `[n+1 depths, n fills]` over every rank's batches (NaN: no output), and
        the loss copy's acceptance per fill, every fill measured on every sequence."""
        n, world, rank = pl_module.geometry.n, trainer.world_size, trainer.global_rank
        metric = GroupedAgreement((n + 1) * n).to(pl_module.device)  # group: depth * n + (fill - 1)
        accepted = GroupedAgreement(n + 1).to(pl_module.device)
        loader = trainer.datamodule.val_dataloader()
        for i, batch in enumerate(loader):
            if i >= self.num_batches:
                break
            if i % world != rank:
                continue
            batch = {k: v.to(pl_module.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            view, drafts = pl_module.staircase_agreement(batch, seed=self.seed + i, pdm=pdm)
            metric.update(view.agree, view.depth * n + (view.fill - 1))
            accepted.update(*drafts.by_fill(drafts.accepted))
        rate = torch.full(((n + 1) * n,), torch.nan, dtype=torch.float64)
        for group, value in metric.compute().items():  # compute() sums the counts over the ranks
            rate[group] = value
        return rate.view(n + 1, n), accepted.compute()

    @staticmethod
    def _sum(trainer, t: torch.Tensor) -> torch.Tensor:
        if trainer.world_size > 1:
            t = trainer.strategy.reduce(t.to(trainer.strategy.root_device), reduce_op="sum").cpu()
        return t

    @staticmethod
    def _gather(trainer, rows: list) -> list:
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            parts = [None] * trainer.world_size
            dist.all_gather_object(parts, rows)
            rows = [r for part in parts for r in part]
        return sorted(rows, key=lambda r: r[0])

    @staticmethod
    def _metrics(counts: torch.Tensor, agreement: torch.Tensor | None, n: int) -> dict[str, float]:
        N, K = counts[0].item(), counts[1].item()
        acc_fill, rej_fill = counts[2 : 2 + n], counts[2 + n : 2 + 2 * n]
        acc_depth, rej_depth = counts[2 + 2 * n : 3 + 3 * n], counts[3 + 3 * n :]
        alpha = N / K if K else 0.0
        m = {
            "staircase/alpha": alpha,
            "staircase/speedup": n * alpha,
            "staircase/N": N,
            "staircase/K": K,
            "staircase/mean_accept_run": (acc_fill.sum() / (rej_fill.sum() + 1)).item(),
        }
        for name, acc, rej, first in (("fill", acc_fill, rej_fill, 1), ("depth", acc_depth, rej_depth, 0)):
            for j, (a, r) in enumerate(zip(acc.tolist(), rej.tolist())):
                if a + r:
                    m[f"staircase/accept_{name}{j + first}"] = a / (a + r)
        if agreement is not None:
            for k in range(n + 1):
                for a in range(1, n + 1):
                    if not agreement[k, a - 1].isnan():
                        m[f"staircase/agree_d{k}_f{a}"] = agreement[k, a - 1].item()
        return m

    @rank_zero_only
    def _log(self, trainer, out: str, metrics: dict, rows: list, agreement: torch.Tensor | None) -> None:
        step = trainer.global_step
        predicted = metrics.get("staircase/predicted_n_alpha")
        rank_zero_info(  # the console line a user watching `fit` reads; the loggers get every number below
            f"staircase evaluation at step {step}: alpha {metrics['staircase/alpha']:.3f}, n*alpha "
            f"{metrics['staircase/speedup']:.2f} measured over {metrics['staircase/N']:.0f} tokens"
            + ("" if predicted is None else f", {predicted:.2f} predicted by the teacher-forced acceptance per fill")
            + f" (plots in {out})"
        )
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        os.makedirs(out, exist_ok=True)
        curve = alpha_curve_png(self.history, os.path.join(out, "alpha_vs_step.png"))
        heat = None
        if agreement is not None:
            heat = heatmap_png(agreement, os.path.join(out, f"agreement_step{step}.png"), step)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                payload = {"staircase/alpha_vs_step": wandb.Image(curve)}
                if heat:
                    payload["staircase/agreement_heatmap"] = wandb.Image(heat)
                if self.log_table:
                    payload["staircase/prompts"] = wandb.Table(
                        columns=["index", "prompt", "output", "N", "K", "alpha"], data=rows
                    )
                logger.experiment.log({**payload, "trainer/global_step": step})

    # -- checkpointed state ----------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        # Two evaluations with different settings (say greedy and sampled) keep separate histories.
        walk = {"method": "walk"} if self.method == "walk" else {}  # a decode's key is what it was before `method`
        return self._generate_state_key(
            every_n_steps=self.every_n_steps, prompts=self.prompt_file, sampling=str(self.sampling.to_dict()), **walk
        )

    def state_dict(self) -> dict:
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = [(int(s), float(a)) for s, a in state_dict.get("history", [])]


def _empty_counts(n: int) -> torch.Tensor:
    """`[N, K, accepted_by_fill(n), rejected_by_fill(n), accepted_by_depth(n+1), rejected_by_depth(n+1)]`, zeros."""
    return torch.zeros(2 + 2 * n + 2 * (n + 1), dtype=torch.float64)


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else str(ids)


def walked_decode(pl_module, pdm, target, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """What the simulator's decode of `prompt` counts (`[N, K, accepted_by_fill, rejected_by_fill,
    accepted_by_depth, rejected_by_depth]`), from `answer`, the target's greedy answer, and the PDM's teacher-forced
    drafts at every fill over it, walked as the decoder walks them (spd_lightning/fill_chain.py)."""
    geometry = pl_module.geometry
    n = geometry.n
    batch = answer_batch(prompt, answer, pl_module.device)
    drafts = pl_module.every_fill(batch, pl_module.teacher_view_of(target, batch), pdm).answer_drafts(0).tolist()
    accepted, rejected = walked_counts(drafts, n)
    by_depth = [[0] * (n + 1), [0] * (n + 1)]
    for k in range(n):  # a fill-(k + 1) draft is drafted at depth `inflight_depth(k)` (the schedule's `_count`)
        by_depth[0][geometry.inflight_depth(k)] += accepted[k]
        by_depth[1][geometry.inflight_depth(k)] += rejected[k]
    N, K = len(drafts) + 1, walked_cycles(drafts, n)
    return torch.tensor([N, K, *accepted, *rejected, *by_depth[0], *by_depth[1]], dtype=torch.float64)
