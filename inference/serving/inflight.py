"""The requests decoding at once in one backend, each followed by the engine thread that asked for it.

A backend's decoder runs elsewhere (the ranks, or a driver thread in this process) and reports in events:
`tokens` (what a cycle verified) and `result`, each tagged with its request's id, and `end` when the decoder
stops serving. `InFlight` routes each event to the one thread waiting for that request (`follow`), which calls
the engine's `on_tokens` there, never in the decoder: a hook that raises (the client is gone, a stop string)
cannot break the decode of the other requests that share the pipeline. Such a request is cancelled inside the
decoder (`cancel_inside(id)`, e.g. the ranks' shared cancel list) and ends with its next verdict; its late
events are dropped. When the decoder ends, every request in flight fails with the one message that says why
(`BackendFailure`: HTTP 503 each), and so does every later one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from inference.backends import BackendFailure, Cancelled, OnTokens
from inference.cycle.result import DecodeResult


class InFlight:
    def __init__(self, cancel_inside: Callable[[int], None]):
        self.cancel_inside = cancel_inside
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._next_id = 0
        self._routes: dict[int, tuple[queue.SimpleQueue, OnTokens | None]] = {}

    def open(self, on_tokens: OnTokens | None) -> int:
        """A new request's id and its route; `BackendFailure` once the decoder has ended."""
        with self._lock:
            if self.failure is not None:
                raise BackendFailure(self.failure)
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._routes[request_id] = (queue.SimpleQueue(), on_tokens)
            return request_id

    def put(self, kind: str, request_id: int, value) -> None:
        """From the decoder's side: `tokens` or `result` of `request_id` (a request no longer followed: dropped)."""
        route = self._routes.get(request_id)
        if route is not None:
            route[0].put((kind, value))

    def end(self, failure: str) -> None:
        """The decoder serves no more: every request in flight, and every later one, fails with `failure`."""
        with self._lock:
            self.failure = failure
            for events, _ in self._routes.values():
                events.put(("ended", failure))

    def cancel(self, on_tokens: OnTokens) -> None:
        """From any thread: stop the request whose hook is `on_tokens` at its next verdict (none: it has ended)."""
        for events, hook in list(self._routes.values()):
            if hook is on_tokens:
                events.put(("cancel", None))  # wakes its `follow`, which tells the decoder at once

    def follow(self, request_id: int, on_cancelled: Callable[[int, DecodeResult], None] | None = None) -> DecodeResult:
        """In the asking thread, until the request's result: its hook gets each cycle's tokens. A hook that
        raises (or a `cancel`) cancels it inside the decoder; its result then raises that exception, after
        `on_cancelled(id, result)`."""
        events, on_tokens = self._routes[request_id]
        cancelled: BaseException | None = None
        try:
            while True:
                kind, value = events.get()
                if kind == "ended":
                    raise BackendFailure(value)
                if kind == "result":
                    if cancelled is None:
                        return value
                    if on_cancelled is not None:
                        on_cancelled(request_id, value)
                    raise cancelled
                if cancelled is not None:
                    continue
                try:
                    if kind == "cancel":
                        raise Cancelled
                    if on_tokens is not None:
                        on_tokens(value)
                except Exception as e:  # noqa: BLE001 - Cancelled / StopString: the decoder stops at its next verdict
                    cancelled = e
                    self.cancel_inside(request_id)
        finally:
            with self._lock:
                del self._routes[request_id]
