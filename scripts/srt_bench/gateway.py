"""The Shepherd Model Gateway (`smg`, the Rust gateway SGLang's router became) in front of srt workers, and the
shared-prefix workload that tells its routing policies apart; used by `scripts/bench_gateway.py` and
`test/integration/test_smg_gateway.py`.

The workload is `groups` long prefixes (a few hundred tokens each, as a shared system prompt or document),
each asked `per_group` short questions, sent group after group in turn. With an odd number of groups, a
round-robin gateway sends every group to both of two workers, so each computes each prefix once; a
cache-aware one keeps a group on the worker that already holds its prefix. The difference shows in srt's
prefix-cache counters (`prefix_hit_rate`).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from srt.metrics.text_format import parse_metrics_text, total
from srt.sockets import find_free_port
from srt_bench.server import PROBE_TIMEOUT_SECONDS, ServerHandle, start_server

CACHE_AWARE, ROUND_ROBIN = "cache_aware", "round_robin"
# A gateway that has not seen every worker healthy in this long failed to start (it probes each at once).
GATEWAY_READY_TIMEOUT_SECONDS = 60.0
# How often the gateway checks a worker's /health, and after how many failures it stops routing there: a
# dead worker is noticed within about a second (its default, 60 s, is for production).
HEALTH_CHECK_INTERVAL_SECONDS = 1
HEALTH_FAILURE_THRESHOLD = 1
# How often the gateway polls each worker's /v1/loads: its first reading comes this soon after start-up.
LOAD_MONITOR_INTERVAL_SECONDS = 1
HITS, QUERIES = "sglang:prefix_cache_hits_total", "sglang:prefix_cache_queries_total"
_TOPICS = ("lighthouses", "glaciers", "violins", "railways", "orchards", "volcanoes", "libraries")


def smg_binary() -> str | None:
    """The `smg` executable beside this interpreter (a virtual environment's), else on PATH."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


def smg_problem() -> str | None:
    """Why `smg` cannot run here (not installed, or it fails to start), or None."""
    binary = smg_binary()
    if binary is None:
        return "the smg binary is not installed (pip install smg)"
    try:
        subprocess.run([binary, "launch", "--help"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{binary} does not run here: {e}"
    return None


def start_gateway(worker_urls: list[str], policy: str, log_level: str = "info") -> ServerHandle:
    """`smg launch` over `worker_urls` on a free port; returns once it reports every worker healthy (raises
    with its log otherwise). Its own Prometheus listener goes to another free port on loopback (its default,
    0.0.0.0:29000, would collide between two gateways)."""
    port, metrics_port = find_free_port(), find_free_port()
    cmd = [
        smg_binary() or "smg", "launch", "--worker-urls", *worker_urls, "--policy", policy,
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_SECONDS),
        "--health-failure-threshold", str(HEALTH_FAILURE_THRESHOLD),
        "--load-monitor-interval", str(LOAD_MONITOR_INTERVAL_SECONDS), "--log-level", log_level,
    ]  # fmt: skip
    gateway = start_server(cmd, port, name="smg")

    def every_worker_healthy() -> str | None:
        try:
            healthy = httpx.get(f"{gateway.base_url}/readiness", timeout=PROBE_TIMEOUT_SECONDS).json()
        except (httpx.HTTPError, ValueError) as e:
            return f"/readiness: {type(e).__name__}"
        seen = healthy.get("healthy_workers")
        return None if seen == len(worker_urls) else f"{seen} of {len(worker_urls)} workers healthy"

    gateway.wait_ready(every_worker_healthy, GATEWAY_READY_TIMEOUT_SECONDS)
    return gateway


@contextlib.contextmanager
def running_gateway(worker_urls: list[str], policy: str, log_level: str = "info") -> Iterator[ServerHandle]:
    gateway = start_gateway(worker_urls, policy, log_level)
    try:
        yield gateway
    finally:
        gateway.stop()
        gateway.log_path.unlink(missing_ok=True)


def shared_prefix_prompts(groups: int, per_group: int, prefix_sentences: int = 12) -> list[str]:
    """`groups * per_group` prompts, group after group in turn (prompt i belongs to group i % groups)."""
    prefixes = [
        " ".join(
            f"Fact {s} about {_TOPICS[g % len(_TOPICS)]} number {g}: they are studied in detail by many people."
            for s in range(prefix_sentences)
        )
        for g in range(groups)
    ]
    return [f"{prefixes[i % groups]}\nQuestion {i}: what is fact {i % prefix_sentences}?\nAnswer:" for i in
            range(groups * per_group)]  # fmt: skip


def prefix_counters(metrics_text: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, looked-up tokens) from one srt server's `/metrics`."""
    samples = parse_metrics_text(metrics_text)
    return total(samples, HITS), total(samples, QUERIES)


def prefix_hit_rate(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float:
    """Hit tokens over looked-up tokens, summed over the workers, between two readings of each."""
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries if queries else 0.0
