"""Speculative decoding metrics (docs/metrics.md, "Speculative decoding"), written by each Scheduler process
once speculation is on: from the start with `--speculative-algorithm`, else from the first verify step (a
request's `prediction`).

Names follow the naming rule: SGLang's prefix, vLLM's base name where SGLang has none
(`spec_decode_num_*`), SGLang's own names for its verify-call counter and its two gauges. The scheduler's
reporter hands over one frozen `SpecStepStats` per verify step, built from the same numbers each request
records, so the sums of the per-request figures equal the counters. `on_verify` only adds integers;
`flush` (at the reporter's flushes) is the only place that touches prometheus.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from srt.speculative.stats import SpecStepStats

GAUGE_MODE = "livemostrecent"


class SpecDecodeMetricsCollector:
    """`labels`: the scheduler's label set. `max_drafts`: the most drafts a request takes in one step; the
    per-position counter's children 0..max_drafts-1 are created at start, so each exports 0 until used."""

    def __init__(self, labels: dict[str, str], max_drafts: int) -> None:
        names = list(labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            child = Gauge(name, doc, names, multiprocess_mode=GAUGE_MODE).labels(**labels)
            child.set(0)
            return child

        self._num_drafts = counter(
            "sglang:spec_decode_num_drafts_total", "Verify steps of a request that had at least one draft."
        )
        self._num_draft_tokens = counter(
            "sglang:spec_decode_num_draft_tokens_total", "Draft tokens proposed and verified."
        )
        self._num_accepted = counter(
            "sglang:spec_decode_num_accepted_tokens_total",
            "Draft tokens accepted and output (the token each step adds after them is not counted).",
        )
        per_pos = Counter(
            "sglang:spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted drafts by their position in the draft (0 first).",
            [*names, "position"],
        )
        self._per_pos = [per_pos.labels(**labels, position=str(j)) for j in range(max_drafts)]
        self._verify_calls = counter("sglang:spec_verify_calls_total", "Forward steps that verified drafts.")
        # OpenAI's usage fields summed over requests (`completion_tokens_details`), srt's names for them
        self._accepted_prediction = counter(
            "sglang:accepted_prediction_tokens_total",
            "Tokens of requests' `prediction` that were drafted and accepted.",
        )
        self._rejected_prediction = counter(
            "sglang:rejected_prediction_tokens_total",
            "Tokens of requests' `prediction` that were drafted and rejected.",
        )
        self._accept_length = gauge(
            "sglang:spec_accept_length",
            "Tokens output per request per verify step (1 + accepted / drafts) since the last flush.",
        )
        self._accept_rate = gauge(
            "sglang:spec_accept_rate", "Accepted / proposed draft tokens since the last flush."
        )
        self._draft_budget = gauge(
            "sglang:spec_draft_tokens_per_request",
            "Drafts a request may take per verify step at the latest decode step's batch size (the k in "
            "effect: it shrinks as the batch grows, 0 where speculation steps aside).",
        )
        self._draft_budget.set(max_drafts)
        self.draft_budget = max_drafts  # the scheduler's latest value, written at the next flush
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._p_calls = 0
        self._p_drafts = 0
        self._p_draft_tokens = 0
        self._p_accepted = 0
        self._p_per_pos = [0] * len(self._per_pos)
        self._p_prediction_drafts = 0
        self._p_prediction_accepted = 0

    def on_verify(self, step: SpecStepStats) -> None:
        self._p_calls += 1
        self._p_drafts += step.num_drafts
        self._p_draft_tokens += step.num_draft_tokens
        self._p_accepted += step.num_accepted_tokens
        for j, n in enumerate(step.accepted_per_position):
            self._p_per_pos[j] += n
        self._p_prediction_drafts += step.num_prediction_draft_tokens
        self._p_prediction_accepted += step.num_accepted_prediction_tokens

    def flush(self) -> None:
        self._draft_budget.set(self.draft_budget)
        if not self._p_calls:
            return
        for child, amount in (
            (self._verify_calls, self._p_calls),
            (self._num_drafts, self._p_drafts),
            (self._num_draft_tokens, self._p_draft_tokens),
            (self._num_accepted, self._p_accepted),
            (self._accepted_prediction, self._p_prediction_accepted),
            (self._rejected_prediction, self._p_prediction_drafts - self._p_prediction_accepted),
            *zip(self._per_pos, self._p_per_pos, strict=True),
        ):
            if amount:
                child.inc(amount)
        if self._p_drafts:
            self._accept_length.set(1 + self._p_accepted / self._p_drafts)
            self._accept_rate.set(self._p_accepted / self._p_draft_tokens)
        self._reset_pending()
