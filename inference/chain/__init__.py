"""EAGLE-3 chain speculative decoding, the baseline (docs/EAGLE3.md): the decoder (`decoder.py`), the target it
verifies with in one forward over k + 1 positions (`target.py`) and the drafter's runtime (`drafter.py`)."""
