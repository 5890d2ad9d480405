""" "What the server says": snapshots of a Prometheus `/metrics` page and the server-side view of one run.

A run's figures are differences of two scrapes (after minus before), so earlier traffic on a long-lived
server does not leak into them. Samples are summed over label sets (model, rank, ...): the benchmark wants
the server's total, whatever the layout of its processes."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

TTFT_METRIC = "sglang:time_to_first_token_seconds"
E2E_METRIC = "sglang:e2e_request_latency_seconds"
QUEUE_METRIC = "sglang:queue_time_seconds"
ITL_METRIC = "sglang:inter_token_latency_seconds"
PROMPT_TOKENS_METRIC = "sglang:prompt_tokens_total"
GENERATION_TOKENS_METRIC = "sglang:generation_tokens_total"
REQUESTS_METRIC = "sglang:num_requests_total"

Snapshot = dict[str, float]


def parse_metrics(text: str) -> Snapshot:
    """Sample name -> value summed over all label sets. Bucket samples are dropped: means need only the
    `_sum` and `_count` of each histogram."""
    totals: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """after - before for every sample present after the run (a sample first seen after counts from 0)."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def histogram_mean(d: Snapshot, metric: str) -> float | None:
    """Mean of the observations a histogram received during the run; None if it received none."""
    count = d.get(f"{metric}_count", 0.0)
    if count <= 0:
        return None
    return d.get(f"{metric}_sum", 0.0) / count


@dataclass
class ServerView:
    """The server's account of one run, in seconds and tokens."""

    requests: float | None
    ttft_mean: float | None
    e2e_mean: float | None
    queue_mean: float | None
    itl_mean: float | None
    prompt_tokens: float | None
    generation_tokens: float | None

    @classmethod
    def from_delta(cls, d: Snapshot) -> ServerView:
        def counter(name: str) -> float | None:
            return d.get(name)

        return cls(
            requests=counter(REQUESTS_METRIC),
            ttft_mean=histogram_mean(d, TTFT_METRIC),
            e2e_mean=histogram_mean(d, E2E_METRIC),
            queue_mean=histogram_mean(d, QUEUE_METRIC),
            itl_mean=histogram_mean(d, ITL_METRIC),
            prompt_tokens=counter(PROMPT_TOKENS_METRIC),
            generation_tokens=counter(GENERATION_TOKENS_METRIC),
        )
