"""One benchmark run: requests arrive as a Poisson process (or all at once), at most `max_concurrency` are
in flight, and `/metrics` is scraped around the run when the server has it."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from srt_bench.backends import Target, send_request
from srt_bench.dataset import BenchRequest
from srt_bench.prom import ServerView, Snapshot, delta, parse_metrics
from srt_bench.stats import BenchmarkSummary, RequestResult, summarize

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
# A server observes a request's histograms when it finishes it, which may be a moment after the client read
# the last chunk; waiting this long before the second scrape keeps the last requests in the run's figures.
METRICS_SETTLE_S = 0.5
SCRAPE_TIMEOUT_S = 10.0
# Benchmarks deliberately overload servers: a request may wait minutes for its first token.
REQUEST_TIMEOUT_S = 6 * 3600


@dataclass
class RunResult:
    max_concurrency: int | None
    request_rate: float
    results: list[RequestResult]
    summary: BenchmarkSummary
    server: ServerView | None

    def to_json(self) -> dict:
        return {
            "max_concurrency": self.max_concurrency,
            "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
            "summary": self.summary.to_json(),
            "server": None if self.server is None else vars(self.server),
            "requests": [r.to_json() for r in self.results],
        }


def new_session(limit: int = 0) -> aiohttp.ClientSession:
    """A session with no per-host connection cap (concurrency is limited by the benchmark, not the pool)."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=limit))


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str) -> Snapshot | None:
    """The server's metrics, or None when it has no Prometheus `/metrics` (most peers)."""
    try:
        async with session.get(
            base_url.rstrip("/") + METRICS_PATH, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        ) as resp:
            if resp.status != 200:
                return None
            return parse_metrics(await resp.text())
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        logger.debug("no usable /metrics: %s", exc)
        return None


def arrival_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), or none for rate inf."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num)]


async def run_interleaved(
    arms: list[list[tuple[Target, BenchRequest]]], count_tokens: Callable[[str], int]
) -> list[RunResult]:
    """One request at a time, request j of every arm in turn (arm i's j-th (target, request)): a slow minute
    of a shared machine reaches every arm alike, where whole runs one after another each meet their own
    minute. An arm's duration is the sum of its own requests' times."""
    results: list[list[RequestResult]] = [[] for _ in arms]
    spent = [0.0] * len(arms)
    async with new_session() as session:
        for j in range(max((len(arm) for arm in arms), default=0)):
            for i, arm in enumerate(arms):
                if j < len(arm):
                    target, req = arm[j]
                    start = time.perf_counter()
                    results[i].append(await send_request(session, target, req, count_tokens, start))
                    spent[i] += time.perf_counter() - start
    return [
        RunResult(1, math.inf, mine, summarize(mine, seconds), None)
        for mine, seconds in zip(results, spent, strict=True)
    ]


async def run_benchmark(
    target: Target,
    requests: list[BenchRequest],
    count_tokens: Callable[[str], int],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    show_progress: bool = True,
) -> RunResult:
    """Send every request once and gather what the client saw and, when available, what the server says."""
    gaps = arrival_gaps(len(requests), request_rate, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with new_session() as session:
        before = await scrape_metrics(session, target.base_url)
        bar = tqdm(total=len(requests), disable=not show_progress, desc=f"conc={max_concurrency or 'inf'}")
        bench_start = time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            if semaphore is None:
                result = await send_request(session, target, req, count_tokens, bench_start)
            else:
                async with semaphore:
                    result = await send_request(session, target, req, count_tokens, bench_start)
            bar.update(1)
            return result

        tasks = []
        for req, gap in zip(requests, gaps, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - bench_start
        bar.close()
        server = None
        if before is not None:
            await asyncio.sleep(METRICS_SETTLE_S)
            after = await scrape_metrics(session, target.base_url)
            if after is not None:
                server = ServerView.from_delta(delta(before, after))
    failed = [r for r in results if not r.success]
    if failed:
        logger.warning(
            "%d of %d requests failed; first error: %s", len(failed), len(results), failed[0].error
        )
    return RunResult(max_concurrency, request_rate, results, summarize(results, duration), server)


async def warmup(target: Target, req: BenchRequest, count_tokens: Callable[[str], int]) -> RequestResult:
    """One request before measuring, so one-time costs (lazy loading, first compilation) stay out of the run."""
    async with new_session() as session:
        return await send_request(session, target, req, count_tokens, time.perf_counter())
