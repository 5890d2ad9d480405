"""What do always-on metrics cost? Serves the same workload with metrics on and with --disable-metrics and
prints the throughput ratio (target >= 0.99) and the /metrics scrape latency p50/p99 under load
(target p99 <= 20 ms).

    .venv/bin/python scripts/bench_metrics_overhead.py [--requests 64 --concurrency 8 --max-tokens 64 --rounds 2]

With `--trace` it measures request tracing instead: --enable-trace at trace level 1 (spans really exported,
over OTLP/HTTP to a receiver this script runs) against tracing off, metrics on in both, no scraping
(target ratio >= 0.98).

Runs alternate (on, off, on, off, ...) so slow drift of a shared machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from srt_bench.server import running_server

logger = logging.getLogger("bench_metrics_overhead")

MODEL = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 300.0
# Scrape once a second during the metrics-on runs: 15x Prometheus's default rate, so the scrape cost is
# included in the throughput comparison at a pessimistic but realistic level.
SCRAPE_PERIOD_S = 1.0
REQUEST_TIMEOUT_S = 600.0
PERCENT = 100.0
TARGET_RATIO = 0.99
TARGET_TRACE_RATIO = 0.98
TARGET_P99_MS = 20.0
# Tracing runs export every second (the SDK's default is 5 s): more exports, a pessimistic measurement.
TRACE_EXPORT_DELAY_MS = 1000


class OtlpSink:
    """An OTLP/HTTP endpoint that accepts every export and counts the payloads (nothing is decoded)."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.exports += 1
                sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def server_args(self) -> list[str]:
        return ["--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{self.port}"]

    @staticmethod
    def env() -> dict[str, str]:
        return {
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": str(TRACE_EXPORT_DELAY_MS),
        }


async def one_request(client: httpx.AsyncClient, i: int, max_tokens: int) -> int:
    body = {"model": MODEL, "prompt": f"Request {i}: write a short story about the sea.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    r = await client.post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def scraper(url: str, stop: asyncio.Event, latencies_ms: list[float], period: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await client.get("/metrics")
            latencies_ms.append((time.perf_counter() - t0) * 1000)
            r.raise_for_status()
            await asyncio.sleep(period)


async def run_workload(url: str, args, scrape: bool) -> tuple[float, list[float]]:
    """Output tokens per second of the workload, and the scrape latencies taken during it."""
    latencies: list[float] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await one_request(client, -1, 4)  # warm-up
        sem = asyncio.Semaphore(args.concurrency)

        async def limited(i: int) -> int:
            async with sem:
                return await one_request(client, i, args.max_tokens)

        scrape_task = (
            asyncio.create_task(scraper(url, stop, latencies, args.scrape_period)) if scrape else None
        )
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(limited(i) for i in range(args.requests))))
        elapsed = time.perf_counter() - t0
        stop.set()
        if scrape_task is not None:
            await scrape_task
    return tokens / elapsed, latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / PERCENT * (len(ordered) - 1)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="on/off pairs")
    p.add_argument("--scrape-period", type=float, default=SCRAPE_PERIOD_S, help="seconds between scrapes")
    p.add_argument("--server-args", default="", help="extra srt flags, e.g. '--max-total-tokens 16384'")
    p.add_argument("--trace", action="store_true", help="measure tracing at level 1 against tracing off")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape would drown the report
    extra = args.server_args.split()
    if args.trace:
        trace_main(args, extra)
        return
    throughput: dict[bool, list[float]] = {True: [], False: []}
    scrapes: list[float] = []
    logdir = tempfile.mkdtemp(prefix="bench-metrics-")
    for rnd in range(args.rounds):
        for metrics_on in (True, False):
            flags = extra if metrics_on else [*extra, "--disable-metrics"]
            log = os.path.join(logdir, f"round{rnd}-{'on' if metrics_on else 'off'}.log")
            with running_server(*flags, log_path=log, timeout=READY_TIMEOUT_S) as server:
                tps, lat = asyncio.run(run_workload(server.base_url, args, scrape=metrics_on))
            throughput[metrics_on].append(tps)
            scrapes.extend(lat)
            logger.info("round %d metrics %s: %.1f output tokens/s", rnd, "on" if metrics_on else "off", tps)
    on, off = statistics.mean(throughput[True]), statistics.mean(throughput[False])
    ratio = on / off
    p50, p99 = percentile(scrapes, 50), percentile(scrapes, 99)
    sys.stdout.write(
        f"throughput metrics on:  {on:.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in throughput[True])})\n"
        f"throughput metrics off: {off:.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in throughput[False])})\n"
        f"ratio on/off: {ratio:.3f}  (target >= {TARGET_RATIO})\n"
        f"/metrics scrape latency under load: p50 {p50:.1f} ms, p99 {p99:.1f} ms over {len(scrapes)} scrapes "
        f"(target p99 <= {TARGET_P99_MS:.0f} ms)\n"
        f"server logs: {logdir}\n"
    )


def trace_main(args, extra: list[str]) -> None:
    """Tracing at level 1 (--enable-trace's start level) against tracing off; metrics on in both."""
    sink = OtlpSink()
    throughput: dict[bool, list[float]] = {True: [], False: []}
    logdir = tempfile.mkdtemp(prefix="bench-trace-")
    for rnd in range(args.rounds):
        for trace_on in (True, False):
            flags = [*extra, *sink.server_args()] if trace_on else extra
            log = os.path.join(logdir, f"round{rnd}-{'trace' if trace_on else 'off'}.log")
            env = sink.env() if trace_on else None
            with running_server(*flags, log_path=log, env=env, timeout=READY_TIMEOUT_S) as server:
                tps, _ = asyncio.run(run_workload(server.base_url, args, scrape=False))
            throughput[trace_on].append(tps)
            logger.info(
                "round %d tracing %s: %.1f output tokens/s", rnd, "level 1" if trace_on else "off", tps
            )
    on, off = statistics.mean(throughput[True]), statistics.mean(throughput[False])
    sys.stdout.write(
        f"throughput tracing level 1: {on:.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in throughput[True])})\n"
        f"throughput tracing off:     {off:.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in throughput[False])})\n"
        f"ratio level 1/off: {on / off:.3f}  (target >= {TARGET_TRACE_RATIO})\n"
        f"OTLP exports received: {sink.exports} ({sink.bytes / 1024:.0f} KiB)\n"
        f"server logs: {logdir}\n"
    )


if __name__ == "__main__":
    main()
