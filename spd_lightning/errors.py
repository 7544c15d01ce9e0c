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


class UsageError(UserError):
    """A bad command line: a flag that is missing, out of range, or does not fit the others."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when the message is empty (never raises)."""
    lines = str(error).splitlines()
    return lines[0] if lines and lines[0].strip() else type(error).__name__
