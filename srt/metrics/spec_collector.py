"""Speculative decoding metrics (docs/metrics.md, "Speculative decoding"), in two parts.

The counters of requests' figures (`SpecRequestMetricsCollector`) are written by the HTTP process when a
request finishes, from the figures its response and its export carry: only there are they final, since a
stop string the detokenizer finds ends an output after the scheduler counted its steps (and such a request
runs a step or two on until its abort arrives). So the sums of the per-request figures equal the counters,
and accepted drafts never exceed the completion tokens (srt/speculative/stats.py).

The step-level families (`SpecDecodeMetricsCollector`: verify calls, the acceptance gauges, the draft budget)
are written by each Scheduler process once speculation is on: from the start with `--speculative-algorithm`,
else from the first verify step (a request's `prediction`). The reporter hands over one frozen
`SpecStepStats` per verify step; `on_verify` only adds integers and `flush` (at the reporter's flushes) is
the only place that touches prometheus.

Names follow the naming rule: SGLang's prefix, vLLM's base name where SGLang has none
(`spec_decode_num_*`), SGLang's own names for its verify-call counter and its two gauges.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from srt.speculative.stats import SpecRequestStats, SpecStepStats

GAUGE_MODE = "livemostrecent"


class SpecRequestMetricsCollector:
    """`labels`: the HTTP process's constant label set. `max_drafts`: the most drafts a request takes in one
    step; the per-position counter's children 0..max_drafts-1 are created at start, so each exports 0 until
    used (a later position, which no step gives, would get its child when first counted)."""

    def __init__(self, labels: dict[str, str], max_drafts: int) -> None:
        names = list(labels)
        self._labels = dict(labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names).labels(**labels)

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
        self._per_pos_family = Counter(
            "sglang:spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted drafts by their position in the draft (0 first).",
            [*names, "position"],
        )
        self._per_pos = [self._per_pos_child(j) for j in range(max_drafts)]
        # OpenAI's usage fields summed over requests (`completion_tokens_details`), srt's names for them
        self._accepted_prediction = counter(
            "sglang:accepted_prediction_tokens_total",
            "Completion tokens that are tokens of the request's `prediction` the model accepted.",
        )
        self._rejected_prediction = counter(
            "sglang:rejected_prediction_tokens_total",
            "Completion tokens where the model output its own token instead of the `prediction`'s.",
        )

    def _per_pos_child(self, position: int) -> Counter:
        return self._per_pos_family.labels(**self._labels, position=str(position))

    def on_request(self, spec: SpecRequestStats) -> None:
        """A finished request's final figures (every finished request that ran a spec step, aborted ones
        too)."""
        per_position = spec.accepted_per_position
        while len(self._per_pos) < len(per_position):
            self._per_pos.append(self._per_pos_child(len(self._per_pos)))
        for child, amount in (
            (self._num_drafts, spec.verify_steps),
            (self._num_draft_tokens, spec.draft_tokens),
            (self._num_accepted, spec.accepted_tokens),
            (self._accepted_prediction, spec.prediction_accepted_tokens),
            (self._rejected_prediction, spec.prediction_rejected_tokens),
            *zip(self._per_pos, per_position, strict=False),
        ):
            if amount:
                child.inc(amount)


class SpecDecodeMetricsCollector:
    """`labels`: the scheduler's label set. `max_drafts`: the most drafts a request takes in one step (the
    draft budget gauge's value until the first decode step sets it). The gauges read the verify steps' own
    totals (a stop string found later is not in them: srt/speculative/stats.py, `SpecStepStats`)."""

    def __init__(self, labels: dict[str, str], max_drafts: int) -> None:
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            child = Gauge(name, doc, names, multiprocess_mode=GAUGE_MODE).labels(**labels)
            child.set(0)
            return child

        self._verify_calls = Counter(
            "sglang:spec_verify_calls_total", "Forward steps that verified drafts.", names
        ).labels(**labels)
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

    def on_verify(self, step: SpecStepStats) -> None:
        self._p_calls += 1
        self._p_drafts += step.num_drafts
        self._p_draft_tokens += step.num_draft_tokens
        self._p_accepted += step.num_accepted_tokens

    def flush(self) -> None:
        self._draft_budget.set(self.draft_budget)
        if not self._p_calls:
            return
        self._verify_calls.inc(self._p_calls)
        if self._p_drafts:
            self._accept_length.set(1 + self._p_accepted / self._p_drafts)
            self._accept_rate.set(self._p_accepted / self._p_draft_tokens)
        self._reset_pending()
