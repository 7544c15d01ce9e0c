"""Helpers the FSDP test runs inside Lightning's ranks (importable there through PYTHONPATH)."""

import json
import os

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy


def _full_state_dict_without_offload(module, world_size: int, rank0_only: bool = True):
    """Lightning's full state-dict context with `offload_to_cpu=False`: on CPU, FSDP's offload "copy" of an
    unsharded parameter is the parameter itself, whose storage FSDP frees right after; cloning it then segfaults
    (rank 0, in `_full_post_state_dict_hook` and in `optim_state_dict`). On a GPU the offload is a real copy."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.state_dict_type(
        module=module,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    )


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on CPU, for tests only. Three things stand in the way there: Lightning refuses the
    `fsdp` strategy unless the accelerator is a GPU (it checks `type(strategy) is FSDPStrategy`, which a subclass
    passes); torch's FSDP refuses a CPU module unless `device_id` names the CPU explicitly, which Lightning
    never does (it passes `root_device.index`, None on CPU); and Lightning's full state dict offloads to the CPU,
    which on CPU frees what it then copies (`_full_state_dict_without_offload`). Everything else is Lightning's
    and torch's own code."""

    def __init__(self, *args, **kwargs):
        from lightning.pytorch.strategies import fsdp as lightning_fsdp

        super().__init__(*args, **kwargs)
        lightning_fsdp._get_full_state_dict_context = _full_state_dict_without_offload

    def _setup_model(self, model):
        import torch
        from torch.distributed import fsdp

        original = fsdp.FullyShardedDataParallel

        class OnCPU(original):
            def __init__(self, *args, device_id=None, **kwargs):
                super().__init__(*args, device_id=torch.device("cpu"), **kwargs)

        fsdp.FullyShardedDataParallel = OnCPU
        try:
            return super()._setup_model(model)
        finally:
            fsdp.FullyShardedDataParallel = original


class FSDPProbe(Callback):
    """Writes, per rank, what FSDP wrapped: the drafter's parameters (the PDM's or EAGLE-3's, sharded) and never the
    frozen target's."""

    def __init__(self, out: str):
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = trainer.strategy.model
        managed = {id(p) for p in wrapped.parameters()}
        drafter = pl_module.pdm if hasattr(pl_module, "pdm") else pl_module.drafter
        names = {id(p): name.replace("_fsdp_wrapped_module.", "") for name, p in drafter.named_parameters()}
        decayed, undecayed = (group["params"] for group in trainer.optimizers[0].param_groups)
        target_params = list(pl_module.target.model.parameters())
        report = {
            "strategy": type(trainer.strategy).__name__,
            "global_step": trainer.global_step,
            "staircase_alpha": "staircase/alpha" in trainer.callback_metrics,
            "root_is_fsdp": isinstance(wrapped, FullyShardedDataParallel),
            "fsdp_units": sum(isinstance(m, FullyShardedDataParallel) for m in wrapped.modules()),
            "target_in_fsdp": any(id(p) in managed for p in target_params),
            "target_has_fsdp": any(isinstance(m, FullyShardedDataParallel) for m in pl_module.target.model.modules()),
            "target_full": all(p.numel() > 0 for p in target_params),
            "target_requires_grad": any(p.requires_grad for p in target_params),
            "decayed": sorted(names[id(p)] for p in decayed),  # the optimizer's groups, by the PDM's plain names
            "undecayed": sorted(names[id(p)] for p in undecayed),
            "sharding": sorted(
                {
                    f"{h._sharding_strategy.name} over {h.world_size}"
                    for h in (unit._handle for unit in FullyShardedDataParallel.fsdp_modules(wrapped))
                    if h
                }
            ),
        }
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(report, f)
