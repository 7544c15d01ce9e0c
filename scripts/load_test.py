"""Load test of `python -m inference.serve`: N concurrent `openai` clients, each streaming requests one after
another, then p50/p95 of TTFT and latency, the tokens per second of the whole run and per request (docs/SERVING.md,
"Under load" and "Batched serving").

    python scripts/load_test.py --port 8000 --model drafter --clients 4 --requests 40 --max-tokens 64

Loopback only (127.0.0.1, ::1 or localhost), and bounded: at most `--requests` requests (1..1000) and
`--time-limit` seconds, after which no client starts another request. TTFT is the time from sending a request
to its first non-empty text chunk; latency to its last chunk; completion tokens come from the server's
usage (`stream_options.include_usage`). tok/s is all the completion tokens over the wall time of the run;
tok/s per request the median of each request's completion tokens over its own latency.
"""

from __future__ import annotations

import argparse
import ipaddress
import statistics
import sys
import threading
import time
from dataclasses import dataclass

from spd_lightning.errors import first_line

LOOPBACK_NAMES = ("localhost",)
MAX_REQUESTS = 1000


@dataclass
class Sample:
    ttft: float | None
    latency: float
    tokens: int
    error: str | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the server's loopback address")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", required=True, help="the model name the server serves (GET /v1/models)")
    p.add_argument("--api-key", default="none")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--requests", type=int, default=40, help=f"requests in all (1..{MAX_REQUESTS})")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds after which no request starts")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (one at a time) before timing")
    args = p.parse_args(argv)
    if not _is_loopback(args.host):
        p.error(f"--host {args.host}: this load test only drives a server on this machine (127.0.0.1, ::1)")
    if not 1 <= args.requests <= MAX_REQUESTS or args.clients < 1 or args.time_limit <= 0:
        p.error(f"need 1 <= --requests <= {MAX_REQUESTS}, --clients >= 1 and --time-limit > 0")
    return args


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def one_request(client, args: argparse.Namespace, index: int) -> Sample:
    import openai

    start, first, tokens = time.perf_counter(), None, 0
    try:
        stream = client.completions.create(
            model=args.model,
            prompt=f"w{index % 50 + 10} w{index % 30 + 40} cat",
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.OpenAIError as e:
        return Sample(None, time.perf_counter() - start, 0, first_line(e))
    return Sample(first - start if first else None, time.perf_counter() - start, tokens)


def run(args: argparse.Namespace) -> tuple[list[Sample], float]:
    import openai

    url = f"http://{args.host if ':' not in args.host else f'[{args.host}]'}:{args.port}/v1"
    client = openai.OpenAI(base_url=url, api_key=args.api_key, timeout=args.time_limit, max_retries=0)
    for i in range(args.warmup):
        one_request(client, args, MAX_REQUESTS + i)
    samples: list[Sample] = []
    lock, counter = threading.Lock(), iter(range(args.requests))
    deadline = time.monotonic() + args.time_limit

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            sample = one_request(client, args, index)
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.time_limit + 60)
    return samples, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def report(args: argparse.Namespace, samples: list[Sample], wall: float) -> str:
    ok = [s for s in samples if s.error is None and s.ttft is not None]
    errors = sorted({s.error for s in samples if s.error})
    lines = [f"{len(samples)} requests ({len(ok)} ok) from {args.clients} clients in {wall:.1f} s"]
    lines += [f"error: {e}" for e in errors]
    if ok:
        ttft = [s.ttft * 1000 for s in ok]
        latency = [s.latency * 1000 for s in ok]
        tokens = sum(s.tokens for s in ok)
        per_request = statistics.median(s.tokens / s.latency for s in ok)
        lines.append(
            "| clients | requests | TTFT p50 | TTFT p95 | latency p50 | latency p95 | tok/s | tok/s per request |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        lines.append(
            f"| {args.clients} | {len(ok)} | {percentile(ttft, 50):.0f} ms | {percentile(ttft, 95):.0f} ms "
            f"| {percentile(latency, 50):.0f} ms | {percentile(latency, 95):.0f} ms | {tokens / wall:.0f} "
            f"| {per_request:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    samples, wall = run(args)
    print(report(args, samples, wall))
    return 0 if samples and all(s.error is None for s in samples) else 1


if __name__ == "__main__":
    sys.exit(main())
