"""Request-level metrics, written by the TokenizerManager in the main process (docs/metrics.md,
"Request-level metrics").

Histograms of request data are observed here, outside the scheduler's forward loop. Label children are
resolved once per label set and kept: a `.labels()` lookup per observation would cost more than the observation.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Histogram

from srt.metrics.buckets import (
    E2E_REQUEST_LATENCY_BUCKETS,
    INTER_TOKEN_LATENCY_BUCKETS,
    PARAMS_N_BUCKETS,
    QUEUE_TIME_BUCKETS,
    RETRACTION_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    one_two_five_buckets,
)
from srt.metrics.request_stats import FinishedRequestStats

FINISHED_REASONS = ("stop", "length", "abort", "error")

# Every family, in the order they are registered: (attribute on the series, metric name, documentation).
COUNTERS = (
    ("prompt_tokens", "sglang:prompt_tokens_total", "Prompt tokens of finished requests."),
    ("generation_tokens", "sglang:generation_tokens_total", "Output tokens of finished requests."),
    (
        "cached_tokens",
        "sglang:cached_tokens_total",
        "Prompt tokens of finished requests served from the prefix cache.",
    ),
    (
        "reasoning_tokens",
        "sglang:reasoning_tokens_total",
        "Output tokens of finished requests through the end of their thinking (--reasoning-parser).",
    ),
    ("num_requests", "sglang:num_requests_total", "Finished requests."),
    (
        "num_aborted",
        "sglang:num_aborted_requests_total",
        "Requests aborted by client disconnect or /abort_request.",
    ),
)
# The histograms' bucket lists, by what they measure (the first three configurable by flags).
TTFT, ITL, E2E, QUEUE, TOKENS, N, RETRACTIONS = "ttft", "itl", "e2e", "queue", "tokens", "n", "retractions"
# (attribute, metric name, documentation, bucket list)
HISTOGRAMS = (
    (
        "ttft",
        "sglang:time_to_first_token_seconds",
        "Time from the HTTP arrival to the first output token (main-process clock).",
        TTFT,
    ),
    (
        "ttfat",
        "sglang:time_to_first_answer_token_seconds",
        "Time from the HTTP arrival to the first answer text after the thinking (--reasoning-parser).",
        TTFT,
    ),
    (
        "itl",
        "sglang:inter_token_latency_seconds",
        "Time between the forward steps that produced successive tokens of a request.",
        ITL,
    ),
    ("tpot", "sglang:time_per_output_token_seconds", "Per request: decode time / (output tokens - 1).", ITL),
    (
        "e2e",
        "sglang:e2e_request_latency_seconds",
        "Time from the HTTP arrival to the final output (main-process clock).",
        E2E,
    ),
    ("queue", "sglang:queue_time_seconds", "Time waiting before first scheduled.", QUEUE),
    (
        "prefill",
        "sglang:request_prefill_time_seconds",
        "First scheduled to first token (includes preemptions during prefill).",
        E2E,
    ),
    (
        "decode",
        "sglang:request_decode_time_seconds",
        "First token to last token (includes preemptions during decode).",
        E2E,
    ),
    ("inference", "sglang:request_inference_time_seconds", "First scheduled to last token.", E2E),
    ("prompt_hist", "sglang:prompt_tokens_histogram", "Prompt tokens per finished request.", TOKENS),
    ("generation_hist", "sglang:generation_tokens_histogram", "Output tokens per finished request.", TOKENS),
    (
        "max_tokens",
        "sglang:request_params_max_tokens",
        "The max_tokens parameter of finished requests.",
        TOKENS,
    ),
    ("n", "sglang:request_params_n", "The n parameter of finished requests.", N),
    (
        "max_generation",
        "sglang:request_max_num_generation_tokens",
        "Output tokens of each finished sample (srt schedules each of n samples as a request).",
        TOKENS,
    ),
    ("retractions", "sglang:num_retractions", "Times each finished request was preempted.", RETRACTIONS),
)


class _Series:
    """The label children of every family for one value of the custom labels, resolved once."""

    def __init__(self, families: dict[str, Counter | Histogram], success: Counter, labels: dict[str, str]):
        for attr, family in families.items():
            setattr(self, attr, family.labels(**labels))
        # Created up front so every reason is exported as 0 and rate() works from the first scrape.
        self.success = {r: success.labels(**labels, finished_reason=r) for r in FINISHED_REASONS}


class TokenizerMetricsCollector:
    """Every metric the main process derives from finished requests and their tokens.

    `labels` is the constant label set (`model_name`); its keys become every family's label names, followed
    by `custom_label_names` (bounded custom labels, srt/metrics/custom_labels.py). Each method takes the
    request's custom label values (`custom`, in `custom_label_names` order; empty when there are none); the
    children of one value set are resolved once and kept, which stays bounded because the values are.
    TTFT is observed by `observe_time_to_first_token` when the first token arrives (streaming or not), not
    at finish, so `observe_finished_request` leaves it alone. srt schedules each of the `n` samples of a
    request as its own request, so the parallel-sampling histograms are observed once per sample."""

    def __init__(
        self,
        labels: dict[str, str],
        context_len: int,
        bucket_time_to_first_token: Sequence[float] | None = None,
        bucket_inter_token_latency: Sequence[float] | None = None,
        bucket_e2e_request_latency: Sequence[float] | None = None,
        custom_label_names: Sequence[str] = (),
    ) -> None:
        self._labels = dict(labels)
        self._custom_names = tuple(custom_label_names)
        names = [*labels, *self._custom_names]
        buckets = {
            TTFT: bucket_time_to_first_token or TIME_TO_FIRST_TOKEN_BUCKETS,
            ITL: bucket_inter_token_latency or INTER_TOKEN_LATENCY_BUCKETS,
            E2E: bucket_e2e_request_latency or E2E_REQUEST_LATENCY_BUCKETS,
            QUEUE: QUEUE_TIME_BUCKETS,
            TOKENS: one_two_five_buckets(context_len),
            N: PARAMS_N_BUCKETS,
            RETRACTIONS: RETRACTION_BUCKETS,
        }
        f: dict[str, Counter | Histogram] = {attr: Counter(name, doc, names) for attr, name, doc in COUNTERS}
        self._success_family = Counter(
            "sglang:request_success_total", "Finished requests by finish reason.", [*names, "finished_reason"]
        )
        for attr, name, doc, kind in HISTOGRAMS:
            f[attr] = Histogram(name, doc, names, buckets=buckets[kind])
        self._families = f
        self._series: dict[tuple[str, ...], _Series] = {}
        self._default = self._get(("",) * len(self._custom_names))

    def _get(self, custom: tuple[str, ...]) -> _Series:
        series = self._series.get(custom)
        if series is None:
            if len(custom) != len(self._custom_names):
                raise ValueError(f"expected values for {self._custom_names}, got {custom!r}")
            labels = {**self._labels, **dict(zip(self._custom_names, custom, strict=True))}
            series = self._series[custom] = _Series(self._families, self._success_family, labels)
        return series

    def _for(self, custom: tuple[str, ...]) -> _Series:
        return self._get(custom) if custom else self._default

    def observe_time_to_first_token(self, seconds: float, custom: tuple[str, ...] = ()) -> None:
        self._for(custom).ttft.observe(seconds)

    def observe_inter_token_latencies(self, seconds: list[float], custom: tuple[str, ...] = ()) -> None:
        itl = self._for(custom).itl
        for s in seconds:
            itl.observe(s)

    def inc_aborted_requests(self, custom: tuple[str, ...] = ()) -> None:
        self._for(custom).num_aborted.inc()

    def observe_finished_request(
        self, stats: FinishedRequestStats, counts_prompt: bool = True, custom: tuple[str, ...] = ()
    ) -> None:
        """Counters and every per-request histogram, once per finished request; intervals that are
        undefined for it (see FinishedRequestStats) are skipped. The prompt and cached token counters follow
        the `usage` rule (each prompt once, however many samples): the caller passes `counts_prompt` for one
        sample per prompt only."""
        s = self._for(custom)
        if counts_prompt:
            s.prompt_tokens.inc(stats.prompt_tokens)
            s.cached_tokens.inc(stats.cached_tokens)
        s.generation_tokens.inc(stats.generation_tokens)
        if stats.reasoning_tokens is not None:
            s.reasoning_tokens.inc(stats.reasoning_tokens)
        s.num_requests.inc()
        success = s.success.get(stats.finished_reason)
        if success is None:  # a reason outside the documented four: keep it, label values stay bounded
            success = s.success["error"]
        success.inc()

        s.e2e.observe(stats.e2e)
        for hist, value in (
            (s.queue, stats.queue_time),
            (s.prefill, stats.prefill_time),
            (s.decode, stats.decode_time),
            (s.inference, stats.inference_time),
            (s.tpot, stats.tpot),
            (s.ttfat, stats.time_to_first_answer_token),
        ):
            if value is not None:
                hist.observe(value)
        s.prompt_hist.observe(stats.prompt_tokens)
        s.generation_hist.observe(stats.generation_tokens)
        s.max_generation.observe(stats.generation_tokens)
        s.max_tokens.observe(stats.max_tokens_param)
        s.n.observe(stats.n_param)
        s.retractions.observe(stats.num_retractions)
