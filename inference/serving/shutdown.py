"""SIGTERM that keeps its promise: uvicorn's server, with the time it waits for the requests in progress
decided when the signal comes (from the tokens they may still ask for and the rate the engine measured), a
503 (an SSE error event on a stream) for the requests still running when that time is up, and exit status 0.
It also says where it listens, once, when it does."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn

log = logging.getLogger("inference.serve")
CUT_GRACE_S = 5.0  # after the cut: time for the cut requests to send their error and close


class GracefulServer(uvicorn.Server):
    """Stops accepting connections, waits up to `timeout()` seconds for the open ones, then ends them with
    `cut(message)` and closes them."""

    def __init__(self, config: uvicorn.Config, timeout: Callable[[], float], cut: Callable[[str], None], url: str):
        super().__init__(config)
        self.timeout, self.cut, self.url = timeout, cut, url

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("listening on %s", self.url)

    async def shutdown(self, sockets=None) -> None:
        wait = self.timeout()
        seconds = f"{wait:.2f}".rstrip("0").rstrip(".")  # 0.3 (--graceful-timeout 0.3), 46.08, 120
        log.warning("stopping: waiting up to %s s for the requests in progress", seconds)
        message = f"the server is stopping and the {seconds} s it waits for requests in progress ran out"
        cutting = asyncio.get_running_loop().call_later(wait, self.cut, message)
        self.config.timeout_graceful_shutdown = wait + CUT_GRACE_S
        try:
            await super().shutdown(sockets)
        finally:
            cutting.cancel()
        self._captured_signals.clear()  # a signal asked for this stop: the exit is a clean 0, not re-raised
