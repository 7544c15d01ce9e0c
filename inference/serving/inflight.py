"""The backends whose decoder serves many requests at once on a thread of their own, each request followed by the
engine thread that asked for it: the ranks (`ranks.RankBackend`, the launcher's thread) and the batched simulator
(`batch_backend.BatchSimulatorBackend`, a driver thread).

`generate` hands a `QueuedRequest` over and follows it. The requests handed over wait here, in order, and go on
to the decoder's FIFO only while it holds fewer than `slots` requests (in its FIFO or decoding): each one there
has a slot to join at the next step boundary, so a request cancelled while it waits for a slot is withdrawn
from the wait (its `generate` raises `Cancelled` at once, freeing its place in the engine) and never reaches
the decoder. The decoder reports in events: `tokens`
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

    def __init__(
        self, requests, cancel_inside: Callable[[int], None], decode: Callable[[], None], thread: str, slots: int
    ):
        """Starts `decode` (it serves the FIFO `requests` over `slots` slots until it reads None) on a thread
        named `thread`."""
        self._queue, self.cancel_inside, self.slots = requests, cancel_inside, slots
        self._waiting: dict[int, QueuedRequest] = {}  # handed over, not yet in the decoder's FIFO (oldest first)
        self._in_decoder = 0  # in the decoder's FIFO or in a slot: at most `slots`
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
        """From the decoder's side: `tokens` or `result` of `request_id` (a request no longer followed: dropped).
        A result frees a slot: the oldest request waiting goes to the decoder's FIFO."""
        if kind == "result":
            with self._lock:
                self._in_decoder -= 1
                self._feed()
        route = self._routes.get(request_id)
        if route is not None:
            route[0].put((kind, value))

    def _feed(self) -> None:
        """Under `_lock`: the oldest requests waiting go to the decoder's FIFO while it has a slot for them."""
        while self._waiting and self._in_decoder < self.slots:
            self._queue.put(self._waiting.pop(next(iter(self._waiting))))
            self._in_decoder += 1

    def cancel(self, on_tokens: OnTokens) -> None:
        """From any thread: stop the request whose hook is `on_tokens` at its next verdict, or now when it still
        waits for a slot (none: it has ended)."""
        with self._lock:
            for request_id, (events, hook) in self._routes.items():
                if hook is on_tokens:
                    withdrawn = self._waiting.pop(request_id, None) is not None
                    events.put(("withdrawn" if withdrawn else "cancel", None))  # wakes its `generate`

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
            self._waiting[request_id] = QueuedRequest(request_id, list(prompt_ids), max_new_tokens, sampling, seed)
            self._feed()
        cancelled: BaseException | None = None
        try:
            while True:
                kind, value = events.get()
                if kind == "ended":
                    raise BackendFailure(value)
                if kind == "withdrawn":  # cancelled before it reached the decoder: nothing to stop there
                    raise Cancelled
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
