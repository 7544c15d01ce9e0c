"""`python -m inference.serve`: the command line of `inference.serving.server` (its docstring is the help)."""

import sys

from inference.serving.server import main

if __name__ == "__main__":
    sys.exit(main())
