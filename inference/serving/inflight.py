"""The backends whose decoder serves many requests at once on a thread of their own, each request followed by the
engine thread that asked for it: the ranks (`ranks.RankBackend`, the launcher's thread) and the batched simulator
(`batch_backend.BatchSimulatorBackend`, a driver thread).

`generate` puts a `QueuedRequest` in the decoder's FIFO and follows it. The decoder reports in events: `tokens`
(what a cycle verified) and `result`, each tagged with its request's id (`put`), and `ended` when it stops
serving. `SlotBackend` routes each event to the one thread waiting for that request, which calls the engine's
`on_tokens` there, never in the decoder: a hook that raises (the client is gone, a stop string) cannot break the
decode of the other requests that share the pipeline. Such a request is cancelled inside the decoder
(`cancel_inside(id)`, e.g. the ranks' shared cancel list) and ends with its next verdict; its late events are
dropped. When the decoder ends, every request in flight fails with the one message that says why
(`BackendFailure`: HTTP 503 each), and so does every later one; `alive` turns false, so the engine builds a
fresh backend.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from inference.backends import BackendFailure, Cancelled, OnTokens
from inference.cycle.result import DecodeResult
from inference.sampling import Sampling
from inference.serving.slot_feed import QueuedRequest
from spd_lightning.errors import first_line


class SlotBackend:
    stopped = "the decoder stopped"  # what a request fails with after the decoder ended cleanly

    def __init__(self, requests, cancel_inside: Callable[[int], None], decode: Callable[[], None], thread: str):
        """Starts `decode` (it serves the FIFO `requests` until it reads None) on a thread named `thread`."""
        self._queue, self.cancel_inside = requests, cancel_inside
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._next_id = 0
        self._routes: dict[int, tuple[queue.SimpleQueue, OnTokens | None]] = {}
        self._thread = threading.Thread(target=self._serve, args=(decode,), name=thread, daemon=True)
        self._thread.start()

    def _serve(self, decode: Callable[[], None]) -> None:
        try:
            decode()
            failure = self.stopped
        except Exception as e:  # noqa: BLE001 - every request in flight gets this message
            failure = first_line(e)
        with self._lock:
            self.failure = failure
            for events, _ in self._routes.values():
                events.put(("ended", failure))

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(30)

    def put(self, kind: str, request_id: int, value) -> None:
        """From the decoder's side: `tokens` or `result` of `request_id` (a request no longer followed: dropped)."""
        route = self._routes.get(request_id)
        if route is not None:
            route[0].put((kind, value))

    def cancel(self, on_tokens: OnTokens) -> None:
        """From any thread: stop the request whose hook is `on_tokens` at its next verdict (none: it has ended)."""
        for events, hook in list(self._routes.values()):
            if hook is on_tokens:
                events.put(("cancel", None))  # wakes its `generate`, which tells the decoder at once

    def _on_cancelled(self, request_id: int, result: DecodeResult) -> None:
        """The result of a request cancelled inside the decoder, before its `generate` raises."""

    def generate(self, prompt_ids, max_new_tokens, sampling: Sampling, seed, on_tokens=None) -> DecodeResult:
        """In the asking thread, until the request's result: `on_tokens` gets each cycle's tokens. A hook that
        raises (or a `cancel`) cancels it inside the decoder; its result then raises that exception.
        `BackendFailure` once the decoder has ended."""
        with self._lock:
            if self.failure is not None:
                raise BackendFailure(self.failure)
            request_id, self._next_id = self._next_id, self._next_id + 1
            events: queue.SimpleQueue = queue.SimpleQueue()
            self._routes[request_id] = (events, on_tokens)
        self._queue.put(QueuedRequest(request_id, list(prompt_ids), max_new_tokens, sampling, seed))
        cancelled: BaseException | None = None
        try:
            while True:
                kind, value = events.get()
                if kind == "ended":
                    raise BackendFailure(value)
                if kind == "result":
                    if cancelled is None:
                        return value
                    self._on_cancelled(request_id, value)
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
