"""The server's engine: weights loaded once, one request decoding at a time, the rest in a bounded FIFO.

SPD is a batch-1 latency method, so the engine runs one decode at a time on one worker thread; requests
wait in a FIFO of `queue_size` (`QueueFull` beyond it, HTTP 429). The worker feeds each request's
verified tokens, as the decoder's per-cycle hook delivers them, through a `TextStream` (stop strings) to
the request's event queue on the server's event loop. A request whose client has gone is cancelled at
the next cycle: the hook raises `Cancelled`, which ends that decode.

The backend (the decoder behind the engine) is one of `inference.backends` in this process, or the
persistent ranks of `inference.serving.ranks`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inference.backends import Backend
from inference.cycle.result import DecodeResult
from inference.sampling import Sampling
from inference.textstream import TextStream

log = logging.getLogger(__name__)


class Cancelled(Exception):
    """The client is gone: the decode stops at this cycle."""


class StopString(Exception):
    """A stop string was generated: the decode stops at this cycle."""


class QueueFull(Exception):
    """Every place in the FIFO is taken."""


@dataclass
class Request:
    """One generation request and the channel its events go back on (to the event loop that waits)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    seed: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class Metrics:
    """What /metrics reports (Prometheus text)."""

    requests: dict[str, int] = field(default_factory=dict)  # by outcome
    tokens: int = 0
    drafts: int = 0  # K of SPD decodes
    verified: int = 0  # N of SPD decodes
    decode_seconds: float = 0.0
    cycles: int = 0
    first_token_seconds: float = 0.0
    first_tokens: int = 0

    def count(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def record(self, result: DecodeResult) -> None:
        self.tokens += result.N
        if result.alpha is not None:
            self.drafts, self.verified = self.drafts + result.K, self.verified + result.N
        self.decode_seconds += result.decode_s
        self.cycles += max(result.K, result.N - 1) if result.alpha is not None else result.N - 1

    def render(self, queue_depth: int, mode: str) -> str:
        lines = ["# TYPE spd_requests_total counter"]
        lines += [f'spd_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        alpha = self.verified / self.drafts if self.drafts else 0.0
        cycle = self.decode_seconds / self.cycles if self.cycles else 0.0
        ttft = self.first_token_seconds / self.first_tokens if self.first_tokens else 0.0
        for name, kind, value in (
            ("spd_generated_tokens_total", "counter", self.tokens),
            ("spd_alpha", "gauge", alpha),
            ("spd_cycle_seconds", "gauge", cycle),
            ("spd_time_to_first_token_seconds", "gauge", ttft),
            ("spd_queue_depth", "gauge", queue_depth),
        ):
            lines += [f"# TYPE {name} {kind}", f'{name}{{mode="{mode}"}} {value}']
        return "\n".join(lines) + "\n"


class Engine:
    """The FIFO and the one worker thread that runs the backend."""

    def __init__(self, make_backend: Callable[[], Backend], tokenizer, mode: str, queue_size: int = 16):
        self.make_backend, self.tokenizer, self.mode = make_backend, tokenizer, mode
        self.backend: Backend | None = make_backend()
        self.metrics = Metrics()
        self._queue: queue.Queue[Request | None] = queue.Queue(maxsize=queue_size)
        self._busy = False
        self._worker = threading.Thread(target=self._serve, name="spd-engine", daemon=True)
        self._worker.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() + int(self._busy)

    def submit(self, request: Request) -> None:
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            self.metrics.count("rejected_queue_full")
            raise QueueFull from None

    def close(self) -> None:
        """After the request in progress; a second call does nothing."""
        if not self._worker.is_alive():
            return
        self._queue.put(None)
        self._worker.join(30)
        if self.backend is not None:
            self.backend.close()

    def _serve(self) -> None:
        while (request := self._queue.get()) is not None:
            self._busy = True
            try:
                self._run(request)
            finally:
                self._busy = False

    def _run(self, request: Request) -> None:
        if request.cancelled.is_set():
            self.metrics.count("cancelled")
            return
        stream = TextStream(self.tokenizer, request.stop)
        first = []

        def on_tokens(tokens: list[int]) -> None:
            if request.cancelled.is_set():
                raise Cancelled
            if not first:
                first.append(time.perf_counter() - request.enqueued)
            delta = stream.feed(tokens)
            if delta:
                request.emit("text", delta)
            if stream.stopped:
                raise StopString

        try:
            result = self.backend.generate(
                request.prompt_ids, request.max_new_tokens, request.sampling, request.seed, on_tokens
            )
            finish = "stop" if result.stop_reason == "eos" else "length"
        except StopString:
            result, finish = None, "stop"
        except Cancelled:
            self.metrics.count("cancelled")
            return
        except Exception as e:  # noqa: BLE001 - the request fails; the engine restarts the backend
            self._failed(request, e)
            return
        if result is not None:
            self.metrics.record(result)
        if first:
            self.metrics.first_tokens += 1
            self.metrics.first_token_seconds += first[0]
        rest = stream.finish()
        if rest:
            request.emit("text", rest)
        self.metrics.count("ok")
        request.emit("done", finish, len(request.prompt_ids), len(stream.tokens))

    def _failed(self, request: Request, error: Exception) -> None:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        log.error("decode failed: %s; restarting the backend", first)
        self.metrics.count("failed")
        request.emit("error", 503, f"the decoder failed: {first}; the pipeline is being restarted, retry")
        try:
            if self.backend is not None:
                self.backend.close()
            self.backend = self.make_backend()
        except Exception as e:  # noqa: BLE001 - serve 503s until a restart works
            log.error("cannot restart the backend: %s", e)
            self.backend = None
