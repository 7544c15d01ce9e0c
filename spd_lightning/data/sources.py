"""Where chat records come from: the embedded ShareGPT, local json/jsonl/parquet files, or the HF hub.

A `DataSource` is a small typed dataclass so LightningCLI/jsonargparse parses a mixture from YAML:

    data:
      sources:
        - {path: sharegpt, weight: 1.0}
        - {path: HuggingFaceH4/ultrachat_200k, split: train_sft, weight: 0.5, max_samples: 20000}
        - {path: /data/my_chats.jsonl, weight: 0.25}

`load_source` returns the raw records as a `datasets.Dataset`; normalization and tokenization happen
later in one cached `datasets.map` (see `tokenized.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

import datasets

from spd_lightning.errors import first_line

from .formats import DataError
from .sharegpt import EMBEDDED_SHAREGPT, embedded_sharegpt_file, load_embedded_sharegpt

LOCAL_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# json files may be gzipped (`datasets` decompresses them): the regenerated answers are committed as .jsonl.gz
COMPRESSED = ".gz"


def local_builder(path: str) -> str | None:
    """The `datasets` builder of a local file by its extension (`x.jsonl.gz` reads as jsonl), or None."""
    stem, ext = os.path.splitext(path.lower())
    if ext == COMPRESSED:
        builder = LOCAL_FILE_BUILDERS.get(os.path.splitext(stem)[1])
        return builder if builder == "json" else None
    return LOCAL_FILE_BUILDERS.get(ext)


@dataclass
class DataSource:
    """One dataset of a mixture.

    path: `sharegpt` (embedded), a local .json/.jsonl(.gz)/.parquet file or dataset directory, or a hub name.
    weight: share of this source in the training mixture (weights are normalized over sources).
    split: the split to read (local files have only `train`).
    subset: the hub configuration name, e.g. `all` for HuggingFaceTB/smoltalk (a dataset's only; refused elsewhere).
    max_samples: read only the first `max_samples` records (tiny runs, tests).
    """

    path: str = EMBEDDED_SHAREGPT
    weight: float = 1.0
    split: str = "train"
    subset: str | None = None
    max_samples: int | None = None

    def __post_init__(self):
        if not self.path:
            raise DataError("a data source needs `path`: `sharegpt`, a local .json/.jsonl/.parquet file, or a hub name")
        if not self.weight > 0:
            raise DataError(
                f"data source {self.path!r} has weight={self.weight}: weights must be > 0 "
                f"(remove the source instead of weighting it 0)"
            )
        if self.max_samples is not None and self.max_samples < 1:
            raise DataError(
                f"data source {self.path!r} has max_samples={self.max_samples}: use a positive count "
                f"or leave it unset for the whole dataset"
            )

    @property
    def kind(self) -> str:
        """`embedded`, `file`, `directory` or `hub`."""
        if self.path == EMBEDDED_SHAREGPT:
            return "embedded"
        local = os.path.expanduser(self.path)
        if os.path.isdir(local):
            return "directory"
        if local_builder(local) is not None or os.path.exists(local):
            return "file"
        return "hub"

    def fingerprint(self) -> str:
        """Changes whenever the records this source yields can change (settings, or a local file's contents)."""
        identity = {k: v for k, v in asdict(self).items() if k != "weight"}
        kind = self.kind
        if kind in ("embedded", "file", "directory"):
            path = embedded_sharegpt_file() if kind == "embedded" else os.path.abspath(os.path.expanduser(self.path))
            identity["files"] = [(f, os.path.getsize(f), os.path.getmtime(f)) for f in _files_under(path)]
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        return []
    return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)


def _split_spec(source: DataSource) -> str:
    return source.split if source.max_samples is None else f"{source.split}[:{source.max_samples}]"


def _load_file(source: DataSource, raw_cache_dir: str) -> datasets.Dataset:
    path = os.path.expanduser(source.path)
    if not os.path.isfile(path):
        raise DataError(
            f"data file {source.path!r} does not exist: fix the path, or use `sharegpt` for the embedded "
            f"default or a hub dataset name"
        )
    builder = local_builder(path)
    if builder is None:
        raise DataError(
            f"data file {source.path!r} has an unsupported extension: use .json, .jsonl (either may be .gz) or .parquet"
        )
    if source.split != "train":
        raise DataError(
            f"data file {source.path!r} is read as split `train`, got split={source.split!r}: "
            f"drop `split` for local files"
        )
    try:
        return datasets.load_dataset(
            builder, data_files={"train": path}, split=_split_spec(source), cache_dir=raw_cache_dir
        )
    except datasets.exceptions.DatasetGenerationError as e:
        cause = e.__cause__ or e
        raise DataError(
            f"cannot read {source.path!r} as {builder} ({type(cause).__name__}: "
            f"{first_line(cause)[:160]}); fix the file or convert it to jsonl/parquet"
        ) from e
    except StopIteration as e:  # `datasets` infers the columns from the first record and finds none
        raise DataError(
            f"data file {source.path!r} holds no record: give it chats (ShareGPT `conversations` or `messages`) or "
            f"drop it from data.sources"
        ) from e


def _load_hub_or_directory(source: DataSource) -> datasets.Dataset:
    try:
        loaded = datasets.load_dataset(os.path.expanduser(source.path), name=source.subset, split=_split_spec(source))
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as e:
        where = "local dataset directory" if source.kind == "directory" else "hub dataset"
        raise DataError(
            f"cannot load {where} {source.path!r} (split {source.split!r}, subset {source.subset!r}): "
            f"{type(e).__name__}: {first_line(e)[:160]}; check the name/split/subset, your "
            f"network or HF_HUB_OFFLINE, or pass a local file"
        ) from e
    return loaded


def load_source(source: DataSource, raw_cache_dir: str) -> datasets.Dataset:
    """The raw records of one source (any columns; the conversation column is checked by the caller)."""
    kind = source.kind
    if source.subset is not None and kind in ("embedded", "file"):  # only a dataset has configurations
        raise DataError(
            f"data source {source.path!r} has no subsets, got subset={source.subset!r}: drop `subset` (it names a "
            f"configuration of a hub or directory dataset)"
        )
    if kind == "embedded":
        if source.split != "train":
            raise DataError(f"the embedded `sharegpt` source has only split `train`, got split={source.split!r}")
        return datasets.Dataset.from_list(load_embedded_sharegpt(source.max_samples))
    if kind == "file":
        return _load_file(source, raw_cache_dir)
    return _load_hub_or_directory(source)
