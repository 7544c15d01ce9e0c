"""The one error policy of the project.

`UserError` is bad input a user can fix (a config value, a path, a flag, a request field): every package raises
a subclass of it, and every CLI prints its message on one line and exits with code 2. Anything else that
escapes is a bug in this project: exit code 1, with the traceback under `--debug` (or `SPD_DEBUG=1`). A reader
of standard output that went away (`| head -1`) is neither: the CLI stops quietly, as one killed by SIGPIPE does
(exit 141).

`run_main` applies the policy for every CLI of the project (`python -m spd_lightning`, `inference.*`). This module
imports only the standard library, so `inference/` can use it without pulling in Lightning.
"""

from __future__ import annotations

import os
import select
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class UserError(ValueError):
    """Bad input: the message says what is wrong and how to fix it, in one line."""

    exit_code = 2


class ConfigError(UserError):
    """A setting that cannot work (a config value, a command-line flag); the message names it and the fix."""


class TargetError(UserError):
    """A target that cannot be found, converted or loaded, or does not fit the request; one line that says why."""


class UsageError(UserError):
    """A bad command line: a flag that is missing, out of range, or does not fit the others."""


class Stopped(Exception):
    """An expected end that is neither success nor bad input, with its own exit code (e.g. SIGTERM after a saved
    step: 143)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when the message is empty (never raises)."""
    lines = str(error).splitlines()
    return lines[0] if lines and lines[0].strip() else type(error).__name__


def one_line(error: BaseException) -> str:
    """The whole message of an error on one line (a parser's message spans several), or its type's name."""
    return " ".join(str(error).split()) or type(error).__name__


@contextmanager
def writing(path: str, what: str = "", fix: str = "choose another output path") -> Iterator[None]:
    """Output the user asked for (`what`, e.g. "the drafter", written to `path`): a path that cannot be written (a
    file where a directory goes, a path under a file, no permission, a full disk) is bad input, not a bug."""
    try:
        yield
    except OSError as e:
        target = f"{what} to {path!r}" if what else repr(path)
        raise UsageError(f"cannot write {target}: {e.strerror or e}; {fix}") from e


def debug_requested(flag: bool = False) -> bool:
    """`--debug` was given, or SPD_DEBUG is set to anything but empty or 0."""
    return flag or os.environ.get("SPD_DEBUG", "") not in ("", "0")


# The exit code of a command line whose standard output was closed by its reader: 128 + SIGPIPE, what a shell
# shows for a program SIGPIPE ended (Python ignores the signal and raises BrokenPipeError instead)
CLOSED_STDOUT_EXIT = 141


def stdout_closed() -> bool:
    """Whether the reader of standard output went away (`| head -1` has read its line): a pipe whose read end is
    closed polls as an error. False when that cannot be told (no poll, no real stdout)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def run_main(work: Callable[[], int], debug: bool) -> int:
    """A CLI's work under the policy; returns its exit code. A `UserError` or `Stopped`: one `error:` line and its
    code; a closed standard output (`stdout_closed`): no line, `CLOSED_STDOUT_EXIT`; anything else is a bug: one
    line and 1. With `debug` every exception but the closed output propagates with its traceback."""
    try:
        code = work()
        sys.stdout.flush()  # a reader that went away shows here, not in Python's own message at exit
        return code
    except (UserError, Stopped) as e:
        if debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - the last line of defence: any other exception is a bug
        if isinstance(e, BrokenPipeError) and stdout_closed():
            # what is still buffered goes nowhere, so that the flush at exit does not fail again (Python's docs, "Note
            # on SIGPIPE")
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return CLOSED_STDOUT_EXIT
        if debug:
            raise
        print(
            f"error: unexpected {type(e).__name__}: {one_line(e)} (a bug: rerun with --debug for the traceback "
            "and report it)",
            file=sys.stderr,
        )
        return 1
