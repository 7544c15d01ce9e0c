"""The server's engine: weights loaded once, up to `max_batch` requests decoding at once, the rest in a FIFO.

Each client request becomes a `Generation`: its prompt and settings, and the channel its events go back on. At
`max_batch` 1 the engine runs one decode at a time on one worker thread; requests wait in a FIFO of
`queue_size` (`QueueFull` beyond it, HTTP 429). A batched backend (`max_batch` B > 1: `--max-batch`) decodes
B requests at once in B slots and keeps its own FIFO, which feeds the slots at step boundaries
(`slot_feed`; a request cancelled while it waits there is withdrawn at once, `SlotBackend.cancel`): the
engine then has a worker thread for every request it admits (B + `queue_size`), each handing its request
over at once and following it. Each worker feeds its request's verified tokens, as the
decoder delivers them, through a `TextStream` (stop strings) to the request's event queue on the server's
event loop.

A request whose client has gone is cancelled at once: `Generation.cancel` (the app calls it the moment it
sees the disconnect) tells the backend, which stops the request at its next verdict (`SlotBackend.cancel`,
the ranks' and the simulator's); the one-request decoders of `--mode ar` and `eagle3` stop when their next
cycle's hook raises `Cancelled`. Either way it counts as `cancelled`.

While idle the workers check the backend every `HEALTH_POLL_S`, so a pipeline whose ranks died is restarted
before the next request comes (when and how: docs/SERVING.md, "One node", Failures).

The backend (the decoder behind the engine) is a `SlotBackend` (the persistent ranks, or the simulator of
`--simulate`), or for `--mode ar` and `eagle3` one of `inference.backends` in this process.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inference.backends import Backend, Cancelled, is_alive, is_ready
from inference.sampling import Sampling
from inference.serving.logs import completion_id
from inference.serving.metrics import Metrics
from inference.textstream import TextStream
from spd_lightning.errors import first_line

__all__ = ["Cancelled", "Engine", "Generation", "QueueFull", "StopString"]
log = logging.getLogger(__name__)
HEALTH_POLL_S = 0.5
MAX_RESTART_DELAY_S = 30.0  # a pipeline that keeps dying before it is ready is retried at most this seldom


class StopString(Exception):
    """A stop string was generated: the decode stops at this cycle."""


class QueueFull(Exception):
    """Every place in the FIFO is taken."""


@dataclass(eq=False)  # hashed by identity: the admitted set holds it
class Generation:
    """One client's request as the engine runs it: its prompt and settings, and the channel its events go back on
    (to the event loop that waits)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    seed: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    completion_id: str = "-"  # the id its client sees (`chatcmpl-...`), on every log line about it
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    on_cancel: Callable[[], None] | None = None  # set by the engine while the generation decodes
    generated: int = 0  # tokens verified so far

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        """The client is gone: stop the decode at its next cycle (a no-op once it has ended)."""
        self.cancelled.set()
        hook = self.on_cancel
        if hook is not None:
            hook()


class Engine:
    """The FIFO and the worker threads that run the backend (one, or one per admitted generation when batched)."""

    def __init__(
        self, make_backend: Callable[[], Backend], tokenizer, mode: str, queue_size: int = 16, max_batch: int = 1
    ):
        self.make_backend, self.tokenizer, self.mode = make_backend, tokenizer, mode
        self.max_batch, self.capacity = max_batch, queue_size + max_batch  # requests admitted at most
        self.backend: Backend | None = make_backend()
        self.metrics = Metrics()
        self._queue: queue.Queue[Generation | None] = queue.Queue()
        self._admitted: set[Generation] = set()  # waiting or decoding
        self._lock = threading.Lock()  # the admitted count and the metrics, written by every worker
        self._restarting = threading.Lock()  # held while the backend is replaced: workers wait for the new one
        self._restart_delay, self._next_restart = 0.0, 0.0
        workers = 1 if max_batch == 1 else self.capacity
        self._workers = [
            threading.Thread(target=self._serve, name=f"spd-engine-{i}", daemon=True) for i in range(workers)
        ]
        for worker in self._workers:
            worker.start()

    @property
    def queue_depth(self) -> int:
        """Generations waiting or decoding."""
        return len(self._admitted)

    def tokens_left(self) -> int:
        """The tokens the admitted requests may still ask for, per slot: what stopping gracefully waits for."""
        with self._lock:
            left = sum(r.max_new_tokens - r.generated for r in self._admitted)
        return -(-left // self.max_batch)

    def cut(self, message: str) -> None:
        """Every admitted generation ends now with a 503 (an SSE error event when streamed) and is cancelled."""
        with self._lock:
            admitted = list(self._admitted)
        for generation in admitted:
            log.warning("%s: cutting %s after %d token(s)", message, generation.completion_id, generation.generated)
            generation.emit("error", 503, message, "server_stopping")
            generation.cancel()

    @property
    def ready(self) -> bool:
        """The pipeline can take a request now: it is up, loaded, and not being restarted."""
        backend = self.backend
        return backend is not None and is_alive(backend) and is_ready(backend)

    def seconds_per_token(self) -> float | None:
        """The mean time between verified tokens so far (None before the first decode)."""
        histogram = self.metrics.per_token
        return histogram.sum / histogram.count if histogram.count else None

    def submit(self, generation: Generation) -> None:
        with self._lock:
            if len(self._admitted) >= self.capacity:
                self.metrics.count("rejected_queue_full")
                raise QueueFull
            self._admitted.add(generation)
        generation.on_cancel = lambda: self._withdraw(generation)  # until a worker takes it (`_run`)
        self._queue.put(generation)

    def _withdraw(self, generation: Generation) -> None:
        """Cancelled while it waits in the FIFO: its place is free at once, not when a worker reaches it (it
        counts as cancelled then); its prompt is dropped, so that abandoned requests hold no memory meanwhile."""
        with self._lock:
            self._admitted.discard(generation)
        generation.prompt_ids = []

    def close(self) -> None:
        """After the requests in progress; a second call does nothing."""
        if not any(worker.is_alive() for worker in self._workers):
            return
        for _ in self._workers:
            self._queue.put(None)
        deadline = time.monotonic() + 30
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        if self.backend is not None:
            self.backend.close()

    def _serve(self) -> None:
        while True:
            try:
                generation = self._queue.get(timeout=HEALTH_POLL_S)
            except queue.Empty:
                self._keep_alive()
                continue
            if generation is None:
                return
            completion_id.set(generation.completion_id)
            try:
                self._keep_alive()
                self._run(generation)
            finally:
                with self._lock:
                    self._admitted.discard(generation)
                completion_id.set("-")

    def _keep_alive(self) -> None:
        """A backend that died (or never started) is replaced now, not when a generation finds it dead; one that
        keeps dying before it is ready is retried after a delay that doubles each time. The log says why it died
        when the backend knows (`failure`): with no request in flight, nobody else hears of it."""
        with self._restarting:
            if (self.backend is None or not is_alive(self.backend)) and time.monotonic() >= self._next_restart:
                failure = getattr(self.backend, "failure", None)
                self._restart(failure or "the pipeline is not running")

    def _run(self, generation: Generation) -> None:
        with self._restarting:  # a restart in progress: wait for the new backend
            backend = self.backend
        if backend is None:
            self._count("failed")
            generation.emit("error", 503, "the pipeline is restarting after a failure; retry", "decoder_failed")
            return
        stream = TextStream(self.tokenizer, generation.stop)
        started = time.perf_counter()
        last = [None]

        def on_tokens(tokens: list[int]) -> None:
            self._timed(generation, started, last, len(tokens))
            if generation.cancelled.is_set():
                raise Cancelled
            delta = stream.feed(tokens)
            if delta:
                generation.emit("text", delta)
            if stream.stopped:
                raise StopString

        cancel = getattr(backend, "cancel", None)  # --mode ar and eagle3 stop at their next `on_tokens`
        generation.on_cancel = (lambda: cancel(on_tokens)) if cancel is not None else None
        if generation.cancelled.is_set():  # gone while it waited (or just now)
            self._cancelled(generation)
            return
        try:
            result = backend.generate(
                generation.prompt_ids, generation.max_new_tokens, generation.sampling, generation.seed, on_tokens
            )
            finish = "stop" if result.stop_reason == "eos" else "length"
            with self._lock:
                self.metrics.record(result)
        except StopString:
            finish = "stop"
        except Cancelled:
            self._cancelled(generation)
            return
        except Exception as e:  # noqa: BLE001 - the generation fails; the engine restarts the backend
            self._failed(generation, e, backend)
            return
        finally:
            generation.on_cancel = None
        rest = stream.finish()
        if rest:
            generation.emit("text", rest)
        self._count("ok")
        generation.emit("done", finish, len(generation.prompt_ids), stream.used_tokens)

    def _cancelled(self, generation: Generation) -> None:
        log.info("cancelled after %d token(s)", generation.generated)
        self._count("cancelled")

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.metrics.count(outcome)

    def _timed(self, generation: Generation, started: float, last: list, count: int) -> None:
        """Tokens, TTFT (without and with the FIFO wait) and the time per token, for every outcome."""
        now = time.perf_counter()
        with self._lock:
            self.metrics.tokens += count
            generation.generated += count
            if count == 0:
                return
            if last[0] is None:
                self.metrics.ttft.observe(now - started)
                self.metrics.ttft_queued.observe(now - generation.enqueued)
            else:
                self.metrics.per_token.observe((now - last[0]) / count, count)
        last[0] = now

    def _failed(self, generation: Generation, error: Exception, backend: Backend) -> None:
        """The generation gets its 503; the first of the requests that shared the failed backend restarts it."""
        first = first_line(error)
        log.error("decode failed: %s; restarting the backend", first)
        self._count("failed")
        message = f"the decoder failed: {first}; the pipeline is being restarted, retry"
        generation.emit("error", 503, message, "decoder_failed")
        with self._restarting:
            if self.backend is backend:
                self._restart(first)

    def _restart(self, why: str) -> None:
        """Under `_restarting`."""
        log.warning("%s: starting a fresh pipeline", why)
        self.metrics.restarts += 1
        backend, self.backend = self.backend, None  # not ready while it restarts
        served = backend is not None and is_ready(backend)
        self._restart_delay = 0.0 if served else min(MAX_RESTART_DELAY_S, max(1.0, 2 * self._restart_delay))
        self._next_restart = time.monotonic() + self._restart_delay
        try:
            if backend is not None:
                backend.close()
            self.backend = self.make_backend()
        except Exception as e:  # noqa: BLE001 - serve 503s until a restart works (retried while idle)
            log.error("cannot restart the backend: %s", e)
