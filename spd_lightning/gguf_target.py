"""A GGUF target converted once into a safetensors checkpoint directory, which every command then reads.

transformers reads a GGUF (`from_pretrained(dir, gguf_file=NAME)`, dequantized to fp32) but slowly (about a
minute for a 135 M model: the tokenizer conversion and the dequantization), and the loaded model refuses
`save_pretrained` because it is marked quantized. So the conversion copies its state dict into a fresh model
of the same config, saves that with the tokenizer and chat template read from the GGUF, and every later load
is a plain safetensors read. The pipeline's ranks load pieces of a target by tensor name (inference/), which
needs exactly such a directory.

The cache entry is keyed by the GGUF's name, size and modification time. Concurrent commands (the n + 1
ranks of a decode, several jobs) are safe: the conversion runs under a file lock, is written to a private
temporary directory and renamed into place, so a reader never sees a partial directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile

from .errors import TargetError, first_line

log = logging.getLogger(__name__)

# Packages the conversion needs beyond the core dependencies, and the extra that installs them
NEEDED = ("gguf", "accelerate")
EXTRA = "gguf"


def target_cache_dir() -> str:
    """Where converted targets live: `SPD_TARGET_CACHE`, else `$XDG_CACHE_HOME/spd_lightning/targets`."""
    if os.environ.get("SPD_TARGET_CACHE"):
        return os.environ["SPD_TARGET_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "spd_lightning", "targets")


def cache_entry(gguf_path: str, cache_dir: str | None = None) -> str:
    """The converted directory of `gguf_path`: its stem plus a key over its real path, size and mtime, so a
    replaced file is converted again and two files of the same name do not collide."""
    real = os.path.realpath(gguf_path)
    stat = os.stat(real)
    key = hashlib.sha256(f"{real}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(real))[0]
    return os.path.join(cache_dir or target_cache_dir(), f"{stem}-{key}")


def check_gguf_support() -> None:
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise TargetError(
            f"reading a GGUF target needs {' and '.join(missing)}: "
            f"`pip install 'spd-lightning[{EXTRA}]'` (or `pip install {' '.join(missing)}`)"
        )


def converted_gguf(gguf_path: str, cache_dir: str | None = None) -> str:
    """The safetensors directory of `gguf_path`, converting it on first use (module doc)."""
    entry = cache_entry(gguf_path, cache_dir)
    if os.path.isfile(os.path.join(entry, "config.json")):
        return entry
    check_gguf_support()
    os.makedirs(os.path.dirname(entry), exist_ok=True)
    with open(entry + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not os.path.isfile(os.path.join(entry, "config.json")):  # another process may have converted it
            _convert_into(gguf_path, entry)
    return entry


def _convert_into(gguf_path: str, entry: str) -> None:
    log.warning(f"converting GGUF target {gguf_path} into {entry} (once; about a minute for a 135 M model)")
    staging = tempfile.mkdtemp(prefix=os.path.basename(entry) + ".tmp-", dir=os.path.dirname(entry))
    try:
        write_checkpoint(gguf_path, staging)
        if os.path.isdir(entry):  # a leftover without config.json (a crash before this code existed)
            shutil.rmtree(entry)
        os.rename(staging, entry)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def load_gguf_model(gguf_path: str):
    """The GGUF as transformers reads it: fp32 weights, dequantized."""
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(os.path.realpath(gguf_path))
    try:
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise TargetError(
            f"cannot read GGUF target {gguf_path!r} ({type(e).__name__}: {first_line(e)[:160]}); "
            f"transformers reads GGUF files of the architectures it lists in its GGUF documentation"
        ) from e


def write_checkpoint(gguf_path: str, out_dir: str) -> None:
    """Write the GGUF's model (fp32 safetensors), tokenizer, chat template and generation config to `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = load_gguf_model(gguf_path)
    config = loaded.config
    for marker in ("quantization_config", "_pre_quantization_dtype"):  # the loaded model is marked quantized
        if hasattr(config, marker):
            delattr(config, marker)
    fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out_dir)
    directory, name = os.path.split(os.path.realpath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    set_special_tokens(tokenizer, gguf_path)
    tokenizer.save_pretrained(out_dir)


def set_special_tokens(tokenizer, gguf_path: str) -> None:
    """The GGUF's own BOS and EOS tokens on `tokenizer`. transformers 5.17 reads both of a byte-level BPE
    vocabulary (SmolLM2's) as the BOS token, so a decode would never stop at the real EOS; the file's metadata
    is right on every release."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    for role in ("bos", "eos"):
        field = reader.get_field(f"tokenizer.ggml.{role}_token_id")
        if field is not None:
            token_id = int(field.parts[field.data[0]][0])
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
