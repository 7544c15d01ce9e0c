"""Training the PDM by online distillation from the frozen target (docs/DESIGN.md, "Training").

module.py           `SPDModule`: the LightningModule (the steps, the PDM's construction, checkpoints)
teacher.py          the frozen target online or its state cache: anchor states and the teacher over V_d
distill.py          one replicated forward's copy distilled: KL, top-1 agreement, greedy acceptance
layouts/            sequence replication: one PDM forward yields every drafting time's view (`depth`, `type`)
attention.py        the PDM's attention backends over a layout's mask (dense, two-part, FlexAttention)
block_sparsity.py   FlexAttention's block mask built once per shape
fill_estimate.py    `fill_probs: auto`: the running acceptance per fill the fill weights follow
metrics.py          grouped agreement (per depth, per fill level) and validation's figures
optimizer.py        AdamW with warmup and decay, clipping under FSDP too: for the PDM and the EAGLE-3 drafter
checkpoint_io.py    checkpoint files written atomically; no diverged or misshapen drafter saved over or resumed into one
checkpoints.py      a run's checkpoints: saved on a stop, a failed write ending every rank, `--ckpt_path` checked first
stopping.py         a run cut off (SIGTERM, Ctrl-C) saves its step's checkpoint
deltanet_fallback.py  the cost of the Gated DeltaNet torch fallback (fit's warning, estimate's step time)
memory_meter.py     peak memory of a step (benchmarks)
"""
