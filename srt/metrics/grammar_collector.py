"""Structured-output metrics (SGLang's names), written by each Scheduler process.

Updates come once per constrained request (arrival, cache hit, queue change) and once per compilation (from
the scheduler's grammar worker thread; prometheus_client's values are lock-protected), never per token.
The queue gauge uses `livemostrecent` and starts at 0, as the scheduler's other gauges (docs/metrics.md,
"Gauges in multiprocess mode").
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from srt.metrics.buckets import GRAMMAR_COMPILATION_BUCKETS

GAUGE_MODE = "livemostrecent"


class GrammarMetricsCollector:
    """`labels`: the scheduler's label set (`model_name`, `tp_rank`, and `dp_rank` with dp > 1)."""

    def __init__(self, labels: dict[str, str]) -> None:
        names = list(labels)
        self._compile_time = Histogram(
            "sglang:grammar_compilation_time_seconds",
            "Time to compile a grammar (JSON schema, regex, EBNF) for the tokenizer, off the scheduler loop.",
            names,
            buckets=GRAMMAR_COMPILATION_BUCKETS,
        ).labels(**labels)
        self._cache_hits = Counter(
            "sglang:num_grammar_cache_hit",
            "Constrained requests whose grammar was already compiled (or compiling).",
            names,
        ).labels(**labels)
        self._so_requests = Counter(
            "sglang:num_so_requests", "Structured-output (grammar-constrained) requests received.", names
        ).labels(**labels)
        self._queue = Gauge(
            "sglang:num_grammar_queue_reqs",
            "Requests waiting for their grammar to compile.",
            names,
            multiprocess_mode=GAUGE_MODE,
        ).labels(**labels)
        self._queue.set(0)
        self._last_queue = 0

    def on_compiled(self, seconds: float) -> None:
        self._compile_time.observe(seconds)

    def on_cache_hit(self) -> None:
        self._cache_hits.inc()

    def on_request(self) -> None:
        self._so_requests.inc()

    def set_queue(self, n: int) -> None:
        if n != self._last_queue:
            self._last_queue = n
            self._queue.set(n)
