"""What `/metrics` reports, in Prometheus' text format: counters, gauges and latency histograms.

The histograms (what each measures: docs/SERVING.md, "The API") are cumulative-bucket histograms as Prometheus
defines them (`_bucket{le=...}`, `_sum`, `_count`), so a scraper computes any quantile over any window.

Written by the engine's worker thread, read by the event loop: each update is a few integer additions
under the GIL, and a scrape that sees one histogram a token ahead of another is harmless.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from inference.cycle.result import DecodeResult

# Up to 10 minutes: a request queued behind many long decodes waits minutes for its first token.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, mode: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip((*self.buckets, "+Inf"), self.counts):
            running += n
            lines.append(f'{self.name}_bucket{{mode="{mode}",le="{bound}"}} {running}')
        lines += [f'{self.name}_sum{{mode="{mode}"}} {self.sum}', f'{self.name}_count{{mode="{mode}"}} {self.count}']
        return lines


@dataclass
class Metrics:
    requests: dict[str, int] = field(default_factory=dict)  # by outcome: ok, cancelled, failed, rejected_*
    tokens: int = 0  # every token the decoder verified, whatever became of its request
    drafts: int = 0  # K of the SPD decodes that ran to their end
    verified: int = 0  # N of the same decodes
    decode_seconds: float = 0.0
    cycles: int = 0
    restarts: int = 0
    ttft: Histogram = field(
        default_factory=lambda: Histogram(
            "spd_time_to_first_token_seconds", "decode start to the first verified token", TTFT_BUCKETS
        )
    )
    ttft_queued: Histogram = field(
        default_factory=lambda: Histogram(
            "spd_time_to_first_token_with_queue_seconds",
            "request arrival (FIFO wait included) to the first verified token",
            TTFT_BUCKETS,
        )
    )
    per_token: Histogram = field(
        default_factory=lambda: Histogram(
            "spd_time_per_output_token_seconds", "time between verified tokens", TOKEN_BUCKETS
        )
    )

    def count(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def record(self, result: DecodeResult) -> None:
        """A decode that ran to its end (eos or max_tokens): what alpha and the cycle time are made of."""
        if result.alpha is not None:
            self.drafts, self.verified = self.drafts + result.K, self.verified + result.N
        self.decode_seconds += result.decode_s
        self.cycles += max(result.K, result.N - 1) if result.alpha is not None else result.N - 1

    def render(self, queue_depth: int, mode: str, ready: bool) -> str:
        lines = [
            "# HELP spd_requests_total requests answered, by outcome (ok, cancelled, failed, rejected_queue_full)",
            "# TYPE spd_requests_total counter",
        ]
        lines += [f'spd_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        alpha = self.verified / self.drafts if self.drafts else 0.0
        cycle = self.decode_seconds / self.cycles if self.cycles else 0.0
        for name, kind, value, help_text in (
            ("spd_generated_tokens_total", "counter", self.tokens, "tokens verified, whatever became of their request"),
            ("spd_pipeline_restarts_total", "counter", self.restarts, "fresh pipelines started after a failure"),
            ("spd_alpha", "gauge", alpha, "verified over drafted tokens (N / K) of the decodes that ran to their end"),
            ("spd_cycle_seconds", "gauge", cycle, "mean cycle time of the decodes that ran to their end"),
            ("spd_queue_depth", "gauge", queue_depth, "requests waiting or decoding"),
            ("spd_ready", "gauge", int(ready), "1 while the pipeline can take a request"),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f'{name}{{mode="{mode}"}} {value}']
        for histogram in (self.ttft, self.ttft_queued, self.per_token):
            lines += histogram.render(mode)
        return "\n".join(lines) + "\n"
