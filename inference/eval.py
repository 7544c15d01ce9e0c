"""`python -m inference.eval`: the command line of `inference.evaluation.run` (its docstring is the help)."""

import sys

from inference.evaluation.run import main

if __name__ == "__main__":
    sys.exit(main())
