"""`python -m spd_lightning prepare --config CFG`: build the data caches once, ahead of the multi-GPU job.

Tokenizing a large mixture (chat rendering, assistant loss masks, length filter) and counting the draft
vocabulary `d2t` takes a while; inside `fit` it runs on local rank 0 while every GPU of the node waits. This
command does it beforehand, on the CPUs (`--data.num_proc N` tokenizes in N processes), into exactly the cache
that `fit --config CFG` then reads: it parses the same config file with the same LightningCLI parser (links,
defaults and command-line overrides included) and builds the same `ChatDataModule`; the target's weights are
never loaded (only its tokenizer).

- Progress: a bar per tokenized source and one for the token counts; one summary line per source.
- Idempotent: when every cache already exists it says so and does nothing.
- Concurrent runs on one cache are safe: each source is built under a file lock (the others wait, then read
  it), and `d2t` is written to a private file and renamed into place.
- `--regenerate OUT.jsonl` first has the target answer the first user turn of every training chat
  (`data/regenerate.py`: batched, resumable, `--temperature`, `--max-new-tokens`, `--gen-batch-size`,
  `--max-prompt-tokens`, `--limit`), then prepares OUT.jsonl as the data source; `fit` trains on it with
  `--data.sources '[{path: OUT.jsonl}]'`.
- `--states DIR` then runs the target once over the prepared samples and stores the hidden states drafters read
  (`prepare_states.py`; `--states-configs A.yaml B.yaml` adds what other configs of the same target and data
  read), so that `fit --data.states DIR` trains without the target.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

import torch
from jsonargparse import ArgumentError

from .cli import SPDLightningCLI
from .data import ChatDataModule
from .data.tokenized import processed_root
from .errors import ConfigError, UsageError, one_line
from .prepare_states import states_parser
from .training.module import SPDModule


class _DataOnlyCLI(SPDLightningCLI):
    """`fit`'s parser (same config file, links and overrides) that instantiates only the data module."""

    def instantiate_classes(self) -> None:
        self.datamodule = ChatDataModule(**self.config.data.as_dict())


def data_module(args: Sequence[str]) -> ChatDataModule:
    """The `ChatDataModule` that `fit` would build from the same arguments (`--config CFG`, overrides)."""
    return _parse(args).datamodule


def model_options(args: Sequence[str]) -> dict:
    """The `SPDModule` options `fit` would use with the same arguments (what a state cache must serve)."""
    model = _parse(args).config.model
    if not issubclass(_model_class(model.class_path), SPDModule):
        raise ConfigError(f"--states serves SPDModule configs; {model.class_path} reads no state cache")
    return model.init_args.as_dict()


def _model_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _parse(args: Sequence[str]) -> _DataOnlyCLI:
    try:
        cli = _DataOnlyCLI(
            args,
            run=False,
            save_config_callback=None,
            parser_kwargs={
                "exit_on_error": False,
                "description": "Tokenize the data of a `fit` config and count its d2t.",
            },
        )
    except ArgumentError as e:  # a value the parser rejects, as in `fit`
        raise ConfigError(one_line(e)) from e
    return cli


def prepare(args: Sequence[str]) -> str:
    """Build the caches `fit` reads; returns what was done, in one line."""
    data = data_module(args)
    where = processed_root(data.cache_dir, data.tokenizer, data.max_length)
    missing = data.missing_caches()
    if not missing:
        return f"already prepared, nothing to do: every source and d2t is cached in {where}"
    print(f"preparing {', '.join(missing)} in {where}", flush=True)
    data.prepare_data()
    return (
        f"prepared {len(data.train_dataset):,} training and {len(data.val_dataset):,} validation samples, "
        f"V_d={len(data.d2t):,}, in {where}"
    )


def regeneration_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--regenerate", metavar="OUT.jsonl", help="the target answers the training prompts first")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--gen-batch-size", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    parser.add_argument("--limit", type=int, default=None, help="answer only the first N prompts")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def regenerate_data(args: Sequence[str], options: argparse.Namespace) -> str:
    """Write the target's answers to the config's prompts into `options.regenerate` (resuming); one line."""
    from .data.regenerate import Generation, first_turns, fitting_prompts, regenerate
    from .target import load_hf_causal_lm

    gen = Generation(
        options.temperature, options.max_new_tokens, options.gen_batch_size, options.max_prompt_tokens, options.seed
    )
    if options.limit is not None and options.limit < 1:
        raise UsageError(f"--limit {options.limit}: use a positive number of prompts (leave it out for all)")
    try:  # the output, before the target loads: a path that cannot be written is bad input
        os.makedirs(os.path.dirname(os.path.abspath(options.regenerate)), exist_ok=True)
        open(options.regenerate, "a").close()
    except OSError as e:
        raise UsageError(
            f"cannot write --regenerate {options.regenerate!r}: {e.strerror or e}; choose another path"
        ) from e
    parsed = _parse(args)
    data, target = parsed.datamodule, parsed.config.model.init_args
    prompts = first_turns(data.sources, os.path.join(data.cache_dir, "raw"), options.limit)
    prompts = fitting_prompts(data.tokenizer, prompts, gen)
    # as the state cache runs it (prepare_states.py): in the config's dtype, on the GPU when there is one
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_hf_causal_lm(data.tokenizer_name, target.target_dtype, device, target.trust_remote_code).eval()
    written, total = regenerate(model, data.tokenizer, prompts, options.regenerate, gen)
    return f"regenerated {written:,} answers now, {total:,} in {options.regenerate}"


def prepare_states(args: Sequence[str], options: argparse.Namespace) -> str:
    """The state cache of the config (and of `--states-configs`, same target and data) in `options.states`."""
    from .prepare_states import config_needs, union_needs, write_states

    data = data_module(args)
    data.setup("fit")  # the samples and d2t `prepare` just cached
    needs = [config_needs(model_options(args))]
    needs += [config_needs(model_options(["--config", path])) for path in options.states_configs]
    return write_states(data, union_needs(needs, options.states_layers), options)


def _check_parent_flags(options: argparse.Namespace, parser: argparse.ArgumentParser, parent: str) -> None:
    """One line for an option of `--regenerate` or `--states` given without it (it was ignored, silently)."""
    if getattr(options, parent):
        return
    given = [f"--{k.replace('_', '-')}" for k, v in vars(options).items() if k != parent and v != parser.get_default(k)]
    if given:
        raise UsageError(f"{', '.join(given)} set(s) how --{parent} runs: add --{parent}, or drop it")


def main(args: Sequence[str]) -> int:
    """`prepare` with fit's arguments (`--config CFG [--data.num_proc N] ...`), optionally after `--regenerate`,
    optionally followed by `--states DIR`; bad input raises a `UserError`, which `python -m spd_lightning` prints as
    one line with exit code 2."""
    options, rest = regeneration_parser().parse_known_args(list(args))
    states, rest = states_parser().parse_known_args(rest)
    _check_parent_flags(options, regeneration_parser(), "regenerate")
    _check_parent_flags(states, states_parser(), "states")
    if options.regenerate:
        print(regenerate_data(rest, options), flush=True)
        rest = [*rest, f"--data.sources=[{{path: {os.path.abspath(options.regenerate)}}}]"]
    print(prepare(rest), flush=True)
    if states.states:
        print(prepare_states(rest, states))
    return 0


if __name__ == "__main__":
    from .cli import main as cli_main

    cli_main(["prepare", *sys.argv[1:]])
