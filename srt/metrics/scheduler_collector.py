"""System-level metrics, written by each Scheduler process (docs/metrics.md, "Scheduler metrics" and
"Saturation").

The scheduler calls the `on_*` methods every step; they only add to plain ints and floats. `flush()`, called
at the scheduler's log steps and when it goes idle, is the only place that touches prometheus: at most one
`Gauge.set` per gauge and one `Counter.inc` per counter, plus the step-size observations gathered since.

Gauges use `livemostrecent`: a dead scheduler's values disappear with it (after `mark_process_dead`), and
they are set to 0 at construction because a never-set gauge exports no sample at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from srt.metrics.buckets import powers_of_two_buckets

GAUGE_MODE = "livemostrecent"
# Finished requests whose KV footprint defines "the recent mix" of max_concurrency_estimate.
RECENT_REQUESTS_WINDOW = 1000
PREFILL_COMPUTE, PREFILL_CACHE, DECODE = "prefill_compute", "prefill_cache", "decode"
MODE_EXTEND, MODE_DECODE = "extend", "decode"
# (attribute, metric name, documentation) of the gauges flushed at log steps, set to 0 at construction.
GAUGES = (
    ("_num_running", "sglang:num_running_reqs", "Requests in the running batch."),
    ("_num_queue", "sglang:num_queue_reqs", "Requests waiting to be scheduled."),
    (
        "_num_used_tokens",
        "sglang:num_used_tokens",
        "KV slots held (evictable radix-cache slots count as free).",
    ),
    ("_token_usage", "sglang:token_usage", "num_used_tokens / max_total_num_tokens."),
    ("_max_total_num_tokens", "sglang:max_total_num_tokens", "KV pool capacity in tokens."),
    (
        "_gen_throughput",
        "sglang:gen_throughput",
        "Decode tokens per second over the last decode-log interval.",
    ),
    ("_cache_hit_rate", "sglang:cache_hit_rate", "Prefix hit rate of the last prefill batch."),
    ("_new_token_ratio", "sglang:new_token_ratio", "Decode-memory reservation ratio."),
    ("_kv_headroom", "sglang:kv_headroom_tokens", "KV slots new work could use now."),
    (
        "_concurrency",
        "sglang:max_concurrency_estimate",
        "Requests of the recent mix (last 1000 finished) that fit in the KV pool.",
    ),
    (
        "_load_factor",
        "sglang:load_factor",
        "(running + queued) / max_concurrency_estimate; above 1 is saturated.",
    ),
    ("_startup_time", "sglang:engine_startup_time", "Seconds from process start to ready."),
    ("_load_weights_time", "sglang:engine_load_weights_time", "Seconds spent loading weights."),
)
# (attribute, metric name, documentation) of the counters without a mode label.
COUNTERS = (
    ("_prefix_queries", "sglang:prefix_cache_queries_total", "Prompt tokens looked up."),
    ("_prefix_hits", "sglang:prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    ("_retracted", "sglang:num_retracted_requests_total", "Preemptions (retractions)."),
)


@dataclass
class SchedulerStats:
    """What the scheduler knows at a log step; flushed into the gauges of the same names."""

    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_used_tokens: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    new_token_ratio: float = 0.0
    kv_headroom_tokens: int = 0


def make_cache_config(
    *,
    page_size: int,
    max_total_num_tokens: int,
    max_running_requests: int,
    chunked_prefill_size: int,
    prefix_caching: bool,
    kv_cache_dtype: str,
    attention_backend: str,
    context_len: int,
) -> dict[str, str]:
    """The label set of `sglang:cache_config_info`. `max_concurrency` is how many requests of full context
    length the KV pool holds at once (vLLM's definition); `num_pages` is the pool in pages, as llm-d's endpoint
    picker reads it (`page_size` x `num_pages` KV tokens)."""
    return {
        "page_size": str(page_size),
        "num_pages": str(max_total_num_tokens // page_size),
        "num_kv_tokens": str(max_total_num_tokens),
        "max_running_requests": str(max_running_requests),
        "chunked_prefill_size": str(chunked_prefill_size),
        "enable_prefix_caching": str(prefix_caching).lower(),
        "kv_cache_dtype": kv_cache_dtype,
        "attention_backend": attention_backend,
        "max_concurrency": f"{max_total_num_tokens / context_len:.2f}",
    }


class RecentFootprint:
    """Mean KV footprint (prompt + output tokens) of the last `size` finished requests, in O(1) per request."""

    def __init__(self, size: int = RECENT_REQUESTS_WINDOW) -> None:
        self._window: deque[int] = deque(maxlen=size)
        self._sum = 0

    def add(self, tokens: int) -> None:
        if len(self._window) == self._window.maxlen:
            self._sum -= self._window[0]
        self._window.append(tokens)
        self._sum += tokens

    def mean(self) -> float | None:
        return self._sum / len(self._window) if self._window else None


def max_concurrency_estimate(capacity: int, mean_footprint: float | None, context_len: int | None) -> float:
    """capacity / mean footprint of the recent mix. Before any request has finished there is no mix: srt
    then assumes the worst case, every request filling the context (capacity / context_len), so that at
    cold start `load_factor` errs high (towards scaling out) rather than reading 0; 0 if that is unknown too."""
    if mean_footprint:
        return capacity / mean_footprint
    if context_len:
        return capacity / context_len
    return 0.0


def load_factor(num_running: int, num_queued: int, concurrency_estimate: float) -> float:
    """(running + queued) / max_concurrency_estimate; above 1, requests wait for memory."""
    if concurrency_estimate <= 0:
        return 0.0
    return (num_running + num_queued) / concurrency_estimate


class SchedulerMetricsCollector:
    """Cheap per-step accumulation, pushed to prometheus in `flush()`.

    `labels`: `model_name`, `tp_rank` and (with dp > 1) `dp_rank`, decided by the caller.
    `cache_config`: the extra labels of `cache_config_info` (see `make_cache_config`).
    `context_len` (optional) makes the cold-start concurrency estimate meaningful; `max_batch_tokens` bounds
    the iteration-tokens buckets (default: the KV capacity)."""

    def __init__(
        self,
        labels: dict[str, str],
        cache_config: dict[str, str],
        max_total_num_tokens: int,
        *,
        context_len: int | None = None,
        max_batch_tokens: int | None = None,
    ) -> None:
        names = list(labels)
        self._labels = labels
        self._capacity = max_total_num_tokens
        self._context_len = context_len

        for attr, name, doc in GAUGES:
            child = Gauge(name, doc, names, multiprocess_mode=GAUGE_MODE).labels(**labels)
            child.set(0)
            setattr(self, attr, child)
        info = Gauge(
            "sglang:cache_config_info",
            "KV cache configuration (value fixed at 1; the labels carry it).",
            [*names, *cache_config],
            multiprocess_mode=GAUGE_MODE,
        )
        info.labels(**labels, **cache_config).set(1)
        self._max_total_num_tokens.set(max_total_num_tokens)
        for attr, name, doc in COUNTERS:
            setattr(self, attr, Counter(name, doc, names).labels(**labels))
        self._declare_step_families(names, labels, max_batch_tokens or max_total_num_tokens)

        self._recent = RecentFootprint()
        self._concurrency.set(self.concurrency_estimate())
        self._reset_pending()

    def _declare_step_families(self, names: list[str], labels: dict[str, str], max_batch_tokens: int) -> None:
        """The families a step adds to: tokens and forward time by mode, and tokens per step."""
        realtime = Counter(
            "sglang:realtime_tokens_total", "Tokens as the scheduler processes them.", [*names, "mode"]
        )
        self._realtime = {
            m: realtime.labels(**labels, mode=m) for m in (PREFILL_COMPUTE, PREFILL_CACHE, DECODE)
        }
        forward = Counter("sglang:forward_seconds_total", "Time spent in model forward.", [*names, "mode"])
        self._forward = {m: forward.labels(**labels, mode=m) for m in (MODE_EXTEND, MODE_DECODE)}
        self._iteration_tokens = Histogram(
            "sglang:iteration_tokens_total",
            "Tokens per forward step (prefill and decode).",
            names,
            buckets=powers_of_two_buckets(max_batch_tokens),
        ).labels(**labels)

    def _reset_pending(self) -> None:
        self._p_queries = 0
        self._p_hits = 0
        self._p_retracted = 0
        self._p_prefill_compute = 0
        self._p_prefill_cache = 0
        self._p_decode = 0
        self._p_extend_seconds = 0.0
        self._p_decode_seconds = 0.0
        self._p_step_tokens: list[int] = []

    # ---- per step: plain arithmetic only ----
    def on_prefill_batch(
        self,
        num_new_seqs: int,
        new_tokens_computed: int,
        cached_tokens: int,
        prefix_queries: int,
        prefix_hits: int,
        forward_seconds: float,
        decode_tokens: int = 0,
    ) -> None:
        """A prefill (extend) step; a mixed step also decoded `decode_tokens` tokens in the same forward,
        which count as decode tokens and in the step's size (its time counts as extend: the mode it ran in)."""
        self._p_prefill_compute += new_tokens_computed
        self._p_prefill_cache += cached_tokens
        self._p_queries += prefix_queries
        self._p_hits += prefix_hits
        self._p_extend_seconds += forward_seconds
        self._p_decode += decode_tokens
        self._p_step_tokens.append(new_tokens_computed + decode_tokens)

    def on_decode_batch(self, num_tokens: int, forward_seconds: float) -> None:
        self._p_decode += num_tokens
        self._p_decode_seconds += forward_seconds
        self._p_step_tokens.append(num_tokens)

    def on_retraction(self, n: int = 1) -> None:
        self._p_retracted += n

    def on_finished_request(self, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> None:
        self._recent.add(prompt_tokens + output_tokens)

    def kv_event_counters(self) -> tuple[Counter, Counter]:
        """(published, dropped) KV cache events; declared on first use, so only a scheduler that publishes
        KV events (--kv-events-config) exports them. The publisher thread increases them."""
        names = list(self._labels)
        published = Counter("sglang:kv_events_published_total", "KV cache events sent to subscribers.", names)
        dropped = Counter(
            "sglang:kv_events_dropped_total",
            "KV cache events dropped because the publisher queue was full.",
            names,
        )
        return published.labels(**self._labels), dropped.labels(**self._labels)

    # ---- at log steps and when going idle ----
    def set_startup_times(self, startup_seconds: float, load_weights_seconds: float) -> None:
        self._startup_time.set(startup_seconds)
        self._load_weights_time.set(load_weights_seconds)

    def concurrency_estimate(self) -> float:
        return max_concurrency_estimate(self._capacity, self._recent.mean(), self._context_len)

    def flush(self, stats: SchedulerStats) -> None:
        self._num_running.set(stats.num_running_reqs)
        self._num_queue.set(stats.num_queue_reqs)
        self._num_used_tokens.set(stats.num_used_tokens)
        self._token_usage.set(stats.token_usage)
        self._gen_throughput.set(stats.gen_throughput)
        self._cache_hit_rate.set(stats.cache_hit_rate)
        self._new_token_ratio.set(stats.new_token_ratio)
        self._kv_headroom.set(stats.kv_headroom_tokens)
        estimate = self.concurrency_estimate()
        self._concurrency.set(estimate)
        self._load_factor.set(load_factor(stats.num_running_reqs, stats.num_queue_reqs, estimate))

        for child, amount in (
            (self._prefix_queries, self._p_queries),
            (self._prefix_hits, self._p_hits),
            (self._retracted, self._p_retracted),
            (self._realtime[PREFILL_COMPUTE], self._p_prefill_compute),
            (self._realtime[PREFILL_CACHE], self._p_prefill_cache),
            (self._realtime[DECODE], self._p_decode),
            (self._forward[MODE_EXTEND], self._p_extend_seconds),
            (self._forward[MODE_DECODE], self._p_decode_seconds),
        ):
            if amount:
                child.inc(amount)
        for tokens in self._p_step_tokens:
            self._iteration_tokens.observe(tokens)
        self._reset_pending()
