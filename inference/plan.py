"""`python -m inference.plan`: the command line of `inference.evaluation.plan` (its docstring is the help)."""

import sys

from inference.evaluation.plan import main

if __name__ == "__main__":
    sys.exit(main())
