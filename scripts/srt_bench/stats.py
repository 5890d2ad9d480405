"""Per-request results and the summary statistics a benchmark prints.

Definitions follow SGLang's bench_serving so numbers are comparable with it: TTFT is the time from sending
the request to the first streamed chunk carrying output; ITL is the gap between successive output chunks;
TPOT is `(e2e - ttft) / (output_len - 1)` per request; throughput divides token totals by the wall time
from the first request sent to the last one finished.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

MS_PER_S = 1000.0
PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass
class RequestResult:
    """What the client saw for one request. Times are seconds; `start` is relative to the benchmark start."""

    prompt_len: int
    output_len: int = 0
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; undefined for one-token outputs."""
        if self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    def to_json(self) -> dict:
        out = asdict(self)
        out["tpot"] = self.tpot
        return out


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass
class LatencyStats:
    """Mean, median, standard deviation and tail percentiles of one latency, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        ms = [s * MS_PER_S for s in seconds]
        avg = mean(ms)
        std = math.sqrt(mean([(x - avg) ** 2 for x in ms])) if ms else math.nan
        return cls(
            mean_ms=avg,
            median_ms=percentile(ms, 50.0),
            std_ms=std,
            p90_ms=percentile(ms, 90.0),
            p95_ms=percentile(ms, 95.0),
            p99_ms=percentile(ms, 99.0),
        )


@dataclass
class BenchmarkSummary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats

    def to_json(self) -> dict:
        return asdict(self)


def summarize(results: list[RequestResult], duration_s: float) -> BenchmarkSummary:
    """Aggregate successful requests; failures only count. `concurrency` is Little's law: the mean number of
    requests in flight, sum of E2E over the wall time."""
    ok = [r for r in results if r.success]
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    return BenchmarkSummary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        input_throughput=total_in / duration_s,
        output_throughput=total_out / duration_s,
        total_throughput=(total_in + total_out) / duration_s,
        concurrency=sum(r.e2e for r in ok) / duration_s,
        ttft=LatencyStats.of([r.ttft for r in ok]),
        tpot=LatencyStats.of([t for r in ok if (t := r.tpot) is not None]),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl]),
        e2e=LatencyStats.of([r.e2e for r in ok]),
    )


def stream_timings(send_time: float, token_times: list[float]) -> tuple[float, list[float]]:
    """TTFT and inter-token gaps from the arrival times of the chunks that carried output.

    Chunks without output (a role-only first delta, a usage-only last chunk) must be left out by the caller:
    counting them would make TTFT look better than what a user waits for. Events that arrive in one network
    read share its arrival time, so their gap is 0: what the client saw (a busy client reads late and gets
    several at once), not an error; the gaps always add up to the span from the first output to the last."""
    if not token_times:
        raise ValueError("no output chunk arrived")
    ttft = token_times[0] - send_time
    itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    return ttft, itl
