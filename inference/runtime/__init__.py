"""What runs on a device during a decode: the target's stages (`stages.py`) with their static caches (`cache.py`), the
PDM drafter (`drafter.py`, `shared_stream.py` for the shared placement) and the compiled one-token steps
(`capture.py`), and their batched counterparts over B slots (`slot_cache.py`, `slot_stage.py`, `slot_drafter.py`;
per-slot values on the device and the batch buckets in `slot_rows.py`). Nothing here knows the schedule:
`inference.cycle` drives these pieces."""
