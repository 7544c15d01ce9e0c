"""What runs on a device during a decode, over B slots (batch 1: one): the target's stages (`stages.py`) with their
static caches (`cache.py`), the PDM drafter (`drafter.py`, `shared_stream.py` for the shared placement), the
compiled one-token steps (`capture.py`), and the per-slot values on the device and the batch buckets
(`slot_rows.py`). Nothing here knows the schedule: `inference.cycle` drives these pieces."""
