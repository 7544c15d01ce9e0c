"""`python -m spd_lightning.tiny_target --out DIR ...` (build.py)."""

import sys

from .build import main

main(sys.argv[1:])
