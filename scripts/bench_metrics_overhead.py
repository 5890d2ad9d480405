"""What do always-on metrics cost? Serves the same workload with metrics on and with --disable-metrics and
prints the throughput ratio (target >= 0.99) and the /metrics scrape latency p50/p99 under load
(target p99 <= 20 ms).

    .venv/bin/python scripts/bench_metrics_overhead.py [--requests 64 --concurrency 8 --max-tokens 64 --rounds 2]

Runs alternate (on, off, on, off, ...) so slow drift of a shared machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

logger = logging.getLogger("bench_metrics_overhead")

MODEL = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 300.0
POLL_S = 0.5
STOP_GRACE_S = 30.0
# Scrape once a second during the metrics-on runs: 15x Prometheus's default rate, so the scrape cost is
# included in the throughput comparison at a pessimistic but realistic level.
SCRAPE_PERIOD_S = 1.0
REQUEST_TIMEOUT_S = 600.0
PERCENT = 100.0
TARGET_RATIO = 0.99
TARGET_P99_MS = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, extra_args: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "srt.launch_server", "--port", str(self.port), *extra_args]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        raise TimeoutError("server not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


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
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape would drown the report
    extra = args.server_args.split()
    throughput: dict[bool, list[float]] = {True: [], False: []}
    scrapes: list[float] = []
    logdir = tempfile.mkdtemp(prefix="bench-metrics-")
    for rnd in range(args.rounds):
        for metrics_on in (True, False):
            flags = extra if metrics_on else [*extra, "--disable-metrics"]
            server = Server(flags, os.path.join(logdir, f"round{rnd}-{'on' if metrics_on else 'off'}.log"))
            try:
                server.wait_ready()
                tps, lat = asyncio.run(run_workload(server.url, args, scrape=metrics_on))
            finally:
                server.stop()
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


if __name__ == "__main__":
    main()
