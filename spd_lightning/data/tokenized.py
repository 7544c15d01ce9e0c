"""Tokenize one source into training samples, cached on disk, and count what had to be dropped.

Layout of the cache (one directory per tokenizer + max_length, one sub-directory per source):

    CACHE/<tokenizer fingerprint>-len<max_length>/<source fingerprint>/rendered*.arrow   every record
    CACHE/<tokenizer fingerprint>-len<max_length>/<source fingerprint>/meta.json         counts; written last

`meta.json` marks a complete build, so an interrupted run rebuilds instead of reading half a cache.
Runs that share a cache (several jobs, or DDP ranks) take an exclusive lock on `<source fingerprint>.lock`
while they check and build, so one builds and the others wait and then read its cache.
Every record keeps a row (with its `status`) so the counts come back with the cache; usable rows are
selected on load. A hit skips reading the raw source entirely.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import datasets
import numpy as np
from lightning.pytorch.utilities import rank_zero_info

from .chat import (
    BAD_RECORD,
    NO_ASSISTANT,
    OK,
    REPLY_NOT_FOUND,
    TEMPLATE_REJECTED,
    TOO_LONG,
    ChatRenderer,
    check_chat_tokenizer,
)
from .formats import DataError, conversation_column
from .sources import DataSource, load_source

# Bump when rendering or masking changes, so old caches are not reused.
PIPELINE_VERSION = 2
FEATURES = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("bool")),
        "status": datasets.Value("string"),
        "prompt": datasets.Value("string"),
    }
)


@dataclass
class SourceStats:
    source: str
    records: int
    kept: int
    too_long: int
    no_assistant: int
    reply_not_found: int
    template_rejected: int
    bad_records: dict[str, int] = field(default_factory=dict)  # reason -> count (unknown role 'tool', ...)

    def summary(self, max_length: int) -> str:
        line = (
            f"{self.source}: {self.records:,} records -> {self.kept:,} samples; dropped {self.too_long:,} over "
            f"max_length={max_length}, {self.no_assistant:,} without assistant tokens"
        )
        if self.reply_not_found:
            line += f", {self.reply_not_found:,} whose reply the chat template rewrote"
        if self.template_rejected:
            line += f", {self.template_rejected:,} the chat template refused"
        if self.bad_records:
            reasons = ", ".join(f"{reason}: {count:,}" for reason, count in sorted(self.bad_records.items()))
            line += f", {sum(self.bad_records.values()):,} unreadable records ({reasons})"
        return line


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Changes when the vocabulary, the merges, the special tokens or the chat template change."""
    digest = hashlib.sha256()
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(str(tokenizer.chat_template).encode())
    digest.update(json.dumps([str(t) for t in tokenizer.all_special_tokens]).encode())
    digest.update(str(PIPELINE_VERSION).encode())
    return digest.hexdigest()[:16]


def processed_root(cache_dir: str, tokenizer: Any, max_length: int) -> str:
    """Where everything derived from this tokenizer and `max_length` lives (samples, draft vocabularies)."""
    return os.path.join(cache_dir, f"{tokenizer_fingerprint(tokenizer)}-len{max_length}")


def source_cache_dir(source: DataSource, tokenizer: Any, max_length: int, cache_dir: str) -> str:
    """The directory of one source's tokenized rows; complete once its `meta.json` exists."""
    return os.path.join(processed_root(cache_dir, tokenizer, max_length), source.fingerprint())


def is_tokenized(source: DataSource, tokenizer: Any, max_length: int, cache_dir: str) -> bool:
    return os.path.isfile(os.path.join(source_cache_dir(source, tokenizer, max_length, cache_dir), "meta.json"))


def _build(
    source: DataSource, tokenizer: Any, max_length: int, cache_dir: str, directory: str, num_proc: int | None
) -> None:
    raw = load_source(source, os.path.join(cache_dir, "raw"))
    column = conversation_column(raw.column_names, f"data source {source.path!r}")
    if len(raw) == 0:
        raise DataError(
            f"data source {source.path!r} (split {source.split!r}) has no records: check the path and split"
        )
    staging = directory + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    rendered = raw.map(
        ChatRenderer(tokenizer, max_length, column, f"data source {source.path!r}"),
        batched=True,
        batch_size=256,
        with_indices=True,
        remove_columns=raw.column_names,
        features=FEATURES,
        num_proc=num_proc,
        cache_file_name=os.path.join(staging, "rendered.arrow"),
        load_from_cache_file=False,
        new_fingerprint=os.path.basename(directory),
        desc=f"Tokenizing {source.path}",
    )
    statuses = Counter(rendered["status"])
    stats = SourceStats(
        source.path,
        len(rendered),
        statuses[OK],
        statuses[TOO_LONG],
        statuses[NO_ASSISTANT],
        statuses[REPLY_NOT_FOUND],
        statuses[TEMPLATE_REJECTED],
        {status[len(BAD_RECORD) :]: count for status, count in statuses.items() if status.startswith(BAD_RECORD)},
    )
    files = [os.path.basename(f["filename"]) for f in rendered.cache_files]
    del rendered  # release the memory map before the directory moves
    with open(os.path.join(staging, "meta.json"), "w") as f:
        json.dump({"stats": asdict(stats), "files": files, "source": asdict(source)}, f, indent=2)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)


@dataclass
class TokenizedSource:
    """Every record of a source as rows (`input_ids`, `loss_mask`, `status`, `prompt`); `usable` indexes the
    rows that can train. Kept as indices so a mixture selects from all sources in one step."""

    rows: datasets.Dataset
    usable: np.ndarray
    stats: SourceStats


def tokenize_source(
    source: DataSource,
    tokenizer: Any,
    tokenizer_name: str,
    max_length: int,
    cache_dir: str,
    num_proc: int | None = None,
) -> TokenizedSource:
    """Tokenize `source` once, then read it from the cache; logs the drop counts and fails when nothing is usable."""
    check_chat_tokenizer(tokenizer, tokenizer_name)
    directory = source_cache_dir(source, tokenizer, max_length, cache_dir)
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        with open(directory + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            if not os.path.isfile(meta_path):  # another run may have built it while this one waited
                _build(source, tokenizer, max_length, cache_dir, directory, num_proc)
    with open(meta_path) as f:
        meta = json.load(f)
    stats = SourceStats(**meta["stats"])
    rendered = datasets.concatenate_datasets(
        [datasets.Dataset.from_file(os.path.join(directory, name)) for name in meta["files"]]
    )
    rank_zero_info(stats.summary(max_length))
    if stats.kept == 0:
        raise DataError(
            f"data source {source.path!r} yields no usable sample ({stats.summary(max_length)}): raise "
            f"max_length, or check that its conversations have assistant replies"
        )
    usable = np.flatnonzero(np.asarray(list(rendered["status"])) == OK)
    return TokenizedSource(rendered, usable, stats)
