"""The server's log lines: a UTC timestamp, the level, the request's completion id (the `chatcmpl-`/`cmpl-`
id its client sees, `-` outside a request), the logger, the message. The id follows the request from its HTTP
handler to the engine thread that decodes it (`completion_id`, set in each), so a cancel or a failure names the
client's id.

    2026-12-02T08:10:11.123Z INFO chatcmpl-5f3a... inference.serve: cancelled after 2 token(s)
"""

from __future__ import annotations

import contextvars
import logging
import time

completion_id: contextvars.ContextVar[str] = contextvars.ContextVar("completion_id", default="-")
FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)s %(completion_id)s %(name)s: %(message)s"


class _CompletionId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "completion_id"):
            record.completion_id = completion_id.get()
        return True


def configure() -> None:
    """Every handler of the root logger (set up by `cli.configure_logging`) writes lines in `FORMAT`."""
    for handler in logging.getLogger().handlers:
        configure_handler(handler)


def configure_handler(handler: logging.Handler) -> None:
    formatter = logging.Formatter(FORMAT, datefmt="%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    handler.addFilter(_CompletionId())
