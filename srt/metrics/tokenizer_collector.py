"""Request-level metrics, written by the TokenizerManager in the main process (METRICS.md "Request level").

Histograms of request data are observed here, outside the scheduler's forward loop. Label children are
resolved once at construction: a `.labels()` lookup per observation would cost more than the observation.
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


class TokenizerMetricsCollector:
    """Every metric the main process derives from finished requests and their tokens.

    `labels` is the constant label set (`model_name`); its keys become every family's label names.
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
    ) -> None:
        names = list(labels)
        ttft_buckets = bucket_time_to_first_token or TIME_TO_FIRST_TOKEN_BUCKETS
        itl_buckets = bucket_inter_token_latency or INTER_TOKEN_LATENCY_BUCKETS
        e2e_buckets = bucket_e2e_request_latency or E2E_REQUEST_LATENCY_BUCKETS
        token_buckets = one_two_five_buckets(context_len)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names).labels(**labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets).labels(**labels)

        self._prompt_tokens = counter("sglang:prompt_tokens_total", "Prompt tokens of finished requests.")
        self._generation_tokens = counter(
            "sglang:generation_tokens_total", "Output tokens of finished requests."
        )
        self._cached_tokens = counter(
            "sglang:cached_tokens_total", "Prompt tokens of finished requests served from the prefix cache."
        )
        self._num_requests = counter("sglang:num_requests_total", "Finished requests.")
        self._num_aborted = counter(
            "sglang:num_aborted_requests_total", "Requests aborted by client disconnect or /abort_request."
        )
        success = Counter(
            "sglang:request_success_total",
            "Finished requests by finish reason.",
            [*names, "finished_reason"],
        )
        # Created up front so every reason is exported as 0 and rate() works from the first scrape.
        self._success = {r: success.labels(**labels, finished_reason=r) for r in FINISHED_REASONS}

        self._ttft = histogram(
            "sglang:time_to_first_token_seconds",
            "Time from the HTTP arrival to the first output token (main-process clock).",
            ttft_buckets,
        )
        self._itl = histogram(
            "sglang:inter_token_latency_seconds",
            "Time between the forward steps that produced successive tokens of a request.",
            itl_buckets,
        )
        self._tpot = histogram(
            "sglang:time_per_output_token_seconds",
            "Per request: decode time / (output tokens - 1).",
            itl_buckets,
        )
        self._e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Time from the HTTP arrival to the final output (main-process clock).",
            e2e_buckets,
        )
        self._queue = histogram(
            "sglang:queue_time_seconds", "Time waiting before first scheduled.", QUEUE_TIME_BUCKETS
        )
        self._prefill = histogram(
            "sglang:request_prefill_time_seconds",
            "First scheduled to first token (includes preemptions during prefill).",
            e2e_buckets,
        )
        self._decode = histogram(
            "sglang:request_decode_time_seconds",
            "First token to last token (includes preemptions during decode).",
            e2e_buckets,
        )
        self._inference = histogram(
            "sglang:request_inference_time_seconds", "First scheduled to last token.", e2e_buckets
        )
        self._prompt_hist = histogram(
            "sglang:prompt_tokens_histogram", "Prompt tokens per finished request.", token_buckets
        )
        self._generation_hist = histogram(
            "sglang:generation_tokens_histogram", "Output tokens per finished request.", token_buckets
        )
        self._max_tokens = histogram(
            "sglang:request_params_max_tokens",
            "The max_tokens parameter of finished requests.",
            token_buckets,
        )
        self._n = histogram(
            "sglang:request_params_n", "The n parameter of finished requests.", PARAMS_N_BUCKETS
        )
        self._max_generation = histogram(
            "sglang:request_max_num_generation_tokens",
            "Output tokens of each finished sample (srt schedules each of n samples as a request).",
            token_buckets,
        )
        self._retractions = histogram(
            "sglang:num_retractions", "Times each finished request was preempted.", RETRACTION_BUCKETS
        )

    def observe_time_to_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token_latencies(self, seconds: list[float]) -> None:
        for s in seconds:
            self._itl.observe(s)

    def inc_aborted_requests(self) -> None:
        self._num_aborted.inc()

    def observe_finished_request(self, stats: FinishedRequestStats, counts_prompt: bool = True) -> None:
        """Counters and every per-request histogram, once per finished request; intervals that are
        undefined for it (see FinishedRequestStats) are skipped. The prompt and cached token counters follow
        the `usage` rule (each prompt once, however many samples): the caller passes `counts_prompt` for one
        sample per prompt only."""
        if counts_prompt:
            self._prompt_tokens.inc(stats.prompt_tokens)
            self._cached_tokens.inc(stats.cached_tokens)
        self._generation_tokens.inc(stats.generation_tokens)
        self._num_requests.inc()
        success = self._success.get(stats.finished_reason)
        if success is None:  # a reason outside the documented four: keep it, label values stay bounded
            success = self._success["error"]
        success.inc()

        self._e2e.observe(stats.e2e)
        for hist, value in (
            (self._queue, stats.queue_time),
            (self._prefill, stats.prefill_time),
            (self._decode, stats.decode_time),
            (self._inference, stats.inference_time),
            (self._tpot, stats.tpot),
        ):
            if value is not None:
                hist.observe(value)
        self._prompt_hist.observe(stats.prompt_tokens)
        self._generation_hist.observe(stats.generation_tokens)
        self._max_generation.observe(stats.generation_tokens)
        self._max_tokens.observe(stats.max_tokens_param)
        self._n.observe(stats.n_param)
        self._retractions.observe(stats.num_retractions)
