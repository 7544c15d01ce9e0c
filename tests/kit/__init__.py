"""The test kit: builders every test module shares, one concept per module (tiny targets, drafters, chi-square
statistics, training and what a run trained on, the hand-computed loss's batch, runs of the repository's scripts and
child processes, the server under test, probes into a decoder run). Nothing here is a test or a fixture: test
modules import it as `from kit import ...` (pytest puts tests/ on sys.path; scripts/bench_runner.py and
scripts/bench_batch.py do too), conftest.py builds its fixtures from it, and no test module imports another
(tests/test_architecture.py). What scripts share with the tests lives in `spd_lightning.testing`: its shrunk `fit`
arguments are re-exported here."""

from spd_lightning.testing import fit_args

from .decoder_probes import (
    LateArrival,
    RecordingTransport,
    assert_same_state,
    check_batched_timing,
    forbid_device_sync,
    slot_state,
)
from .drafters import (
    ANCHOR_BATCH,
    ANCHOR_HIDDEN,
    ANCHOR_VOCAB,
    agreeing_pdm,
    anchor_pdm,
    padded_anchor_states,
    random_pdm,
    save_random_drafter,
    saved_random_drafter,
)
from .loss_batch import LOSS_LENGTHS, LOSS_T, TEACHER_T, attached_module, loss_batch, loss_target
from .runs import (
    DEMO_PROMPTS,
    REPO,
    callback_args,
    child_pids,
    csv_rows,
    descendant_pids,
    free_port,
    load_script,
    still_alive,
)
from .serving import (
    SERVE_KEY,
    TOKEN_S,
    Letters,
    Server,
    SlowBackend,
    chat_reply,
    served,
    simulated_decode,
    started,
)
from .stats import chisquare_pvalues, exact_distributions, merged_chisquare, pooling, random_dist
from .targets import TINY_VOCAB, hf_logits, make_tiny_model, nearly_bigram_target, save_target, target_dir
from .training import (
    Record,
    RecordSamples,
    StopAt,
    SyntheticChat,
    attach_stub_trainer,
    chat_records,
    make_data,
    make_module,
    make_trainer,
    not_resumable_warnings,
    sample_keys,
)

__all__ = [
    "ANCHOR_BATCH",
    "ANCHOR_HIDDEN",
    "ANCHOR_VOCAB",
    "DEMO_PROMPTS",
    "LOSS_LENGTHS",
    "LOSS_T",
    "REPO",
    "SERVE_KEY",
    "TEACHER_T",
    "TINY_VOCAB",
    "TOKEN_S",
    "LateArrival",
    "Letters",
    "Record",
    "RecordSamples",
    "RecordingTransport",
    "Server",
    "SlowBackend",
    "StopAt",
    "SyntheticChat",
    "agreeing_pdm",
    "anchor_pdm",
    "assert_same_state",
    "attach_stub_trainer",
    "attached_module",
    "callback_args",
    "check_batched_timing",
    "chat_records",
    "chat_reply",
    "child_pids",
    "chisquare_pvalues",
    "csv_rows",
    "descendant_pids",
    "exact_distributions",
    "fit_args",
    "forbid_device_sync",
    "free_port",
    "hf_logits",
    "load_script",
    "loss_batch",
    "loss_target",
    "make_data",
    "make_module",
    "make_tiny_model",
    "make_trainer",
    "merged_chisquare",
    "nearly_bigram_target",
    "not_resumable_warnings",
    "padded_anchor_states",
    "pooling",
    "random_dist",
    "random_pdm",
    "sample_keys",
    "save_random_drafter",
    "save_target",
    "saved_random_drafter",
    "served",
    "simulated_decode",
    "slot_state",
    "started",
    "still_alive",
    "target_dir",
]
