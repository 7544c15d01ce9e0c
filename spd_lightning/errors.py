"""The one error policy of the project.

`UserError` is bad input a user can fix (a config value, a path, a flag, a request field): every package raises
a subclass of it, and every CLI prints its message on one line and exits with code 2. Anything else that
escapes is a bug in this project: exit code 1, with the traceback under `--debug` (or `SPD_DEBUG=1`).

This module imports nothing, so `inference/` can use it without pulling in Lightning.
"""


class UserError(ValueError):
    """Bad input: the message says what is wrong and how to fix it, in one line."""

    exit_code = 2


class ConfigError(UserError):
    """A setting that cannot work (a config value, a command-line flag); the message names it and the fix."""


class TargetError(UserError):
    """A target that cannot be loaded or does not fit the request; one line that says why."""
