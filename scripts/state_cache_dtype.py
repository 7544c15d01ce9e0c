"""Does a bfloat16 state cache give the float32 cache's loss? Prepares both caches for a `fit` config and compares the
training loss of every training batch (the model the config builds, seeded as it would be; no optimizer step).

    python scripts/state_cache_dtype.py --out /tmp/cache_dtype -- --config configs/smollm2.yaml \
      --data.sources '[{path: artifacts/smollm2/regen_t0.jsonl, max_samples: 40}]' --data.val_size 8 \
      --data.draft_vocab_size 512 --model.init_from drafters/smollm2-135m

Prints, per dtype, the loss of each batch and the shards' bytes, then the largest relative gap and the size ratio.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import torch

from spd_lightning import prepare
from spd_lightning.training.module import SPDModule


def cached_module(fit_args: list[str], states: str):
    """The config's data module reading `states`, and its SPDModule set up on it as a Trainer would (no Trainer)."""
    data = prepare.data_module([*fit_args, "--data.states", states])
    data.setup("fit")
    # Fixed fills (every level; `auto` would start an untrained estimate at fill 1), the same draws for both caches.
    options = {**prepare.model_options(fit_args), "attention_backend": "dense", "fill_probs": None}
    module = SPDModule(**options)
    module._trainer = SimpleNamespace(  # what setup, configure_model and training_step read of a trainer
        datamodule=data,
        strategy=SimpleNamespace(root_device=torch.device("cpu")),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(total_batch_idx=0)),
        global_rank=0,
    )
    module.log = lambda *args, **kwargs: None
    module.optimizers = lambda: SimpleNamespace(param_groups=[{"lr": 0.0}])
    module.setup("fit")
    torch.manual_seed(0)
    module.configure_model()
    return module, data


def losses(fit_args: list[str], states: str) -> list[float]:
    module, data = cached_module(fit_args, states)
    with torch.no_grad():
        return [module.training_step(batch, 0).item() for batch in data.train_dataloader()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the two caches")
    parser.add_argument("fit_args", nargs=argparse.REMAINDER, help="-- then the `fit` config and overrides")
    opts = parser.parse_args(argv)
    fit_args = [a for a in opts.fit_args if a != "--"]
    result = {}
    for dtype in ("float32", "bfloat16"):
        states = os.path.join(opts.out, dtype)
        assert prepare.main([*fit_args, "--states", states, "--states-dtype", dtype]) == 0
        size = sum(
            os.path.getsize(os.path.join(states, f)) for f in os.listdir(states) if f.startswith(("train", "val"))
        )
        result[dtype] = losses(fit_args, states), size
        print(f"{dtype}: losses {[round(x, 5) for x in result[dtype][0]]}, shards {size:,} bytes")
    (exact, exact_size), (half, half_size) = result["float32"], result["bfloat16"]
    gap = max(abs(a - b) / a for a, b in zip(exact, half))
    print(f"largest relative loss gap {gap:.2e}, size ratio {half_size / exact_size:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
