"""Histogram bucket lists, named once (docs/metrics.md, "Buckets"). Reference lists are SGLang 0.5.9's and
vLLM 0.33's, so dashboards built for either read srt's histograms at the same resolution."""

from __future__ import annotations

import math

# vLLM's fine end of the TTFT range: on a CPU server short prompts answer well under SGLang's first 0.1 s bucket.
TTFT_FINE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08)
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
TIME_TO_FIRST_TOKEN_BUCKETS = TTFT_FINE_BUCKETS + SGLANG_TTFT_BUCKETS

INTER_TOKEN_LATENCY_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip

E2E_REQUEST_LATENCY_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400,
)  # fmt: skip

QUEUE_TIME_BUCKETS = (
    0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300,
    400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
)  # fmt: skip

# Times a request was preempted: fine where it is common, coarse in the pathological tail.
RETRACTION_BUCKETS = tuple(range(11)) + (15, 20, 25, 30, 40, 50, 75, 100)

# The `n` of parallel sampling (vLLM's request_params_n).
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)

# KV residency: 1 ms to 30 min in 21 roughly geometric steps (vLLM's range).
KV_RESIDENCY_MIN_SECONDS = 0.001
KV_RESIDENCY_MAX_SECONDS = 1800.0
KV_RESIDENCY_NUM_BUCKETS = 21
_SIGNIFICANT_DIGITS = 2

_ONE_TWO_FIVE = (1, 2, 5)


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including the first value >= max_value (vLLM's token-count series):
    the top bucket still separates requests that used the whole context from those that nearly did."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in _ONE_TWO_FIVE:
            value = m * scale
            buckets.append(value)
            if value >= max_value:
                return buckets
        scale *= 10


def powers_of_two_buckets(max_value: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_value (tokens per forward step)."""
    buckets = [1]
    while buckets[-1] < max_value:
        buckets.append(buckets[-1] * 2)
    return buckets


def _round_significant(x: float, digits: int) -> float:
    return round(x, digits - 1 - math.floor(math.log10(x)))


def geometric_buckets(low: float, high: float, count: int) -> list[float]:
    """`count` buckets from `low` to `high`, equal ratios, rounded to two significant digits for readable `le`."""
    ratio = (high / low) ** (1 / (count - 1))
    inner = [_round_significant(low * ratio**i, _SIGNIFICANT_DIGITS) for i in range(1, count - 1)]
    return [low, *inner, high]


KV_RESIDENCY_BUCKETS = tuple(
    geometric_buckets(KV_RESIDENCY_MIN_SECONDS, KV_RESIDENCY_MAX_SECONDS, KV_RESIDENCY_NUM_BUCKETS)
)

# Grammar compilation: llguidance compiles a JSON schema in milliseconds, xgrammar in about a second on a CPU,
# and a pathological schema can take a minute.
GRAMMAR_COMPILATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
