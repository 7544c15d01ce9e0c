"""The SPD pipeline decoder: deployable without any training code (docs/DESIGN.md, "The decoder").

Packages, each one concept, lower layers never importing higher ones:
    sampling.py   sampling settings and the distributions they define (no other inference import)
    runtime/      what runs on a device: the target's stages, the PDM drafter, KV caches, compiled steps
    cycle/        one decode: the schedule, verification, messages, the runner, the simulator, AR
    processes/    the n + 1 ranks: the job, the launcher, roles, nodes, reports, fault injection
    chain/        EAGLE-3 chain decoding (the baseline), in one process
    setup.py, backends.py   what a decode needs, and the in-process decoders behind decode, eval and serve
    serving/      the OpenAI-compatible server on top of a backend
    evaluation/   evaluation against AR, the reports, the deployment planner
Command lines (thin, over `cli.py`): `python -m inference.decode | eval | serve | plan --help`.
"""

from spd_lightning.environment.versions import INFERENCE, require_supported

# Before any module of the package imports transformers: a release below the floor ends every `python -m
# inference.*` command with one `error:` line instead of failing (or silently decoding without a cache) later.
require_supported(INFERENCE)
