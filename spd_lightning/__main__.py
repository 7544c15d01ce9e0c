"""`python -m spd_lightning fit|validate|export ...` (see spd_lightning/cli.py)."""

from .cli import main

if __name__ == "__main__":
    main()
