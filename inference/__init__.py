"""The SPD pipeline decoder (SPEC section 5): deployable without any training code.

Python entry points:
    Simulator / simulate_decode   one process, every rank in sequence (staircase evaluation, benchmarks)
    launch(DecodeJob)             n stage ranks + 1 PDM rank as local processes (gloo on CPU, NCCL on GPU)
    ar_decode / ar_decode_stages  plain autoregressive decoding through the same stages (the reference)
Command line: `python -m inference.decode --help`.
"""

from .ar import ar_decode, ar_decode_stages, target_eos
from .drafter import PDMDrafter, ReplayDrafter
from .launch import DecodeJob, LaunchError, Replay, launch
from .result import DecodeResult
from .simulator import Simulator, simulate_decode
from .verify import Sampling

__all__ = [
    "ar_decode",
    "ar_decode_stages",
    "target_eos",
    "PDMDrafter",
    "ReplayDrafter",
    "DecodeJob",
    "LaunchError",
    "Replay",
    "launch",
    "DecodeResult",
    "Simulator",
    "simulate_decode",
    "Sampling",
]
