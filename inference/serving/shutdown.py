"""SIGTERM that keeps its promise: uvicorn's server, with the time it waits for the requests in progress
decided when the signal comes (from the rate the engine has measured), not when the server starts."""

from __future__ import annotations

import logging
from collections.abc import Callable

import uvicorn

log = logging.getLogger("inference.serve")


class GracefulServer(uvicorn.Server):
    """Stops accepting connections, waits up to `timeout()` seconds for the open ones, then cuts them."""

    def __init__(self, config: uvicorn.Config, timeout: Callable[[], float]):
        super().__init__(config)
        self.timeout = timeout

    async def shutdown(self, sockets=None) -> None:
        self.config.timeout_graceful_shutdown = self.timeout()
        log.warning(
            "stopping: waiting up to %.0f s for the requests in progress", self.config.timeout_graceful_shutdown
        )
        await super().shutdown(sockets)
