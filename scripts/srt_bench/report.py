"""Text the benchmark prints: SGLang bench_serving's summary layout (so readers know where to look), the
server's own account beside the client's, and one table for a concurrency sweep."""

from __future__ import annotations

import math

from srt_bench.prom import ServerView
from srt_bench.runner import RunResult
from srt_bench.stats import MS_PER_S, BenchmarkSummary, LatencyStats, mean

WIDTH = 50
LABEL_WIDTH = 40


def _title(text: str, fill: str = "-") -> str:
    return f" {text} ".center(WIDTH, fill)


def _row(label: str, value) -> str:
    if isinstance(value, float):
        value = "nan" if math.isnan(value) else f"{value:.2f}"
    return f"{label + ':':<{LABEL_WIDTH}} {value}"


def _latency_rows(name: str, stats: LatencyStats, with_p95: bool = False) -> list[str]:
    rows = [
        _row(f"Mean {name} (ms)", stats.mean_ms),
        _row(f"Median {name} (ms)", stats.median_ms),
    ]
    if with_p95:
        rows.append(_row(f"P95 {name} (ms)", stats.p95_ms))
    rows.append(_row(f"P99 {name} (ms)", stats.p99_ms))
    return rows


def format_summary(run: RunResult, backend: str) -> str:
    s: BenchmarkSummary = run.summary
    rate = "inf" if math.isinf(run.request_rate) else f"{run.request_rate:g}"
    lines = [
        _title("Serving Benchmark Result", "="),
        _row("Backend", backend),
        _row("Traffic request rate", rate),
        _row("Max request concurrency", run.max_concurrency or "not set"),
        _row("Successful requests", s.completed),
        _row("Failed requests", s.failed),
        _row("Benchmark duration (s)", s.duration_s),
        _row("Total input tokens", s.total_input_tokens),
        _row("Total generated tokens", s.total_output_tokens),
        _row("Request throughput (req/s)", s.request_throughput),
        _row("Input token throughput (tok/s)", s.input_throughput),
        _row("Output token throughput (tok/s)", s.output_throughput),
        _row("Total token throughput (tok/s)", s.total_throughput),
        _row("Concurrency", s.concurrency),
        _title("End-to-End Latency"),
        *_latency_rows("E2E Latency", s.e2e),
        _title("Time to First Token"),
        *_latency_rows("TTFT", s.ttft),
        _title("Time per Output Token (excl. 1st token)"),
        *_latency_rows("TPOT", s.tpot),
        _title("Inter-Token Latency"),
        *_latency_rows("ITL", s.itl, with_p95=True),
        "=" * WIDTH,
    ]
    return "\n".join(lines)


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * scale:.2f}"


def server_comparison_rows(run: RunResult) -> list[tuple[str, float | None, float | None, float]]:
    """(quantity, client, server, scale) for the quantities both sides measure or only the server does."""
    ok = [r for r in run.results if r.success]
    server: ServerView = run.server
    return [
        ("Requests", float(len(ok)), server.requests, 1.0),
        ("Mean TTFT (ms)", mean([r.ttft for r in ok]), server.ttft_mean, MS_PER_S),
        ("Mean E2E latency (ms)", mean([r.e2e for r in ok]), server.e2e_mean, MS_PER_S),
        ("Mean ITL (ms)", mean([g for r in ok for g in r.itl]), server.itl_mean, MS_PER_S),
        ("Mean queue time (ms)", None, server.queue_mean, MS_PER_S),
        ("Input tokens", float(run.summary.total_input_tokens), server.prompt_tokens, 1.0),
        ("Output tokens", float(run.summary.total_output_tokens), server.generation_tokens, 1.0),
    ]


def format_server_comparison(run: RunResult) -> str:
    """Client vs server figures for the run; client minus server is the time outside the server (network,
    HTTP parsing, the client's event loop), and should be small and positive for latencies."""
    if run.server is None:
        return "The server exposes no Prometheus /metrics: no server-side figures for this run."
    header = f"{'':<24}{'client':>12}{'server':>12}{'client-server':>15}"
    lines = [_title("What the server says (/metrics)", "-"), header]
    for name, client, server, scale in server_comparison_rows(run):
        diff = None if client is None or server is None else client - server
        lines.append(f"{name:<24}{_fmt(client, scale):>12}{_fmt(server, scale):>12}{_fmt(diff, scale):>15}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_sweep(runs: list[RunResult]) -> str:
    """One line per concurrency level: throughput and the latencies a user feels, p50 and p99."""
    header = (
        f"{'concurrency':>11} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'E2E p99':>9}   (latencies in ms)"
    )
    lines = [header]
    for run in runs:
        s = run.summary
        lines.append(
            f"{run.max_concurrency or 'inf':>11} {s.request_throughput:>7.2f} {s.output_throughput:>9.2f} "
            f"{s.ttft.median_ms:>9.1f} {s.ttft.p99_ms:>9.1f} {s.itl.median_ms:>8.1f} {s.itl.p99_ms:>8.1f} "
            f"{s.e2e.p99_ms:>9.1f}"
        )
    return "\n".join(lines)
