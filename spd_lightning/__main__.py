"""`python -m spd_lightning fit|validate|export ...` (see spd_lightning/cli.py)."""

from .environment.versions import TRAINING, require_supported

require_supported(TRAINING)  # before .cli imports Lightning: an older release ends in one `error:` line

from .cli import main  # noqa: E402

if __name__ == "__main__":
    main()
