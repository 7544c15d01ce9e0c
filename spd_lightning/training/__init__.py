"""Training the PDM by online distillation from the frozen target (docs/DESIGN.md, "Training").

module.py          `SPDModule`: the LightningModule (the frozen target beside it, the loss, the optimizer)
layouts.py         sequence replication: one PDM forward yields every drafting time's view (`depth`, `type`)
attention.py       the PDM's attention backends over a layout's mask (dense, two-part, FlexAttention)
block_sparsity.py  FlexAttention's block mask built once per shape
metrics.py         grouped agreement (per depth, per fill level)
optimizer.py       AdamW with warmup and decay, clipping under FSDP too: for the PDM and the EAGLE-3 drafter
checkpoint_io.py   checkpoint files written atomically; no diverged or misshapen drafter saved over or resumed into one
memory_meter.py    peak memory of a step (benchmarks)
"""
