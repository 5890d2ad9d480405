"""The benchmark's arithmetic: percentiles, throughput, TPOT and stream timings, on hand-checked numbers."""

import math

import numpy as np
import pytest

from srt_bench.stats import RequestResult, percentile, stream_timings, summarize


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear_interpolation(q):
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.3]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan_and_out_of_range_is_an_error():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_of_one_value_is_that_value():
    assert percentile([0.25], 99) == 0.25


def _ok(prompt_len, output_len, ttft, e2e, itl=()):
    return RequestResult(prompt_len, output_len, success=True, ttft=ttft, e2e=e2e, itl=list(itl))


def test_throughput_divides_token_totals_by_wall_time_and_ignores_failures():
    results = [
        _ok(100, 10, ttft=0.5, e2e=2.0, itl=[0.1] * 9),
        _ok(300, 30, ttft=1.5, e2e=4.0, itl=[0.2] * 29),
        RequestResult(prompt_len=1000, error="HTTP 500"),
    ]
    s = summarize(results, duration_s=4.0)
    assert (s.completed, s.failed) == (2, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (400, 40)
    assert s.request_throughput == pytest.approx(0.5)
    assert s.input_throughput == pytest.approx(100.0)
    assert s.output_throughput == pytest.approx(10.0)
    assert s.total_throughput == pytest.approx(110.0)
    # Little's law: 6 request-seconds in flight over 4 s of wall time
    assert s.concurrency == pytest.approx(1.5)


def test_latency_statistics_are_reported_in_milliseconds():
    s = summarize([_ok(1, 3, ttft=0.2, e2e=1.0, itl=[0.3, 0.5]), _ok(1, 3, ttft=0.4, e2e=1.0)], 2.0)
    assert s.ttft.mean_ms == pytest.approx(300.0)
    assert s.ttft.median_ms == pytest.approx(300.0)
    assert s.ttft.std_ms == pytest.approx(100.0)
    assert s.e2e.p99_ms == pytest.approx(1000.0)
    assert s.itl.mean_ms == pytest.approx(400.0)


def test_tpot_excludes_the_first_token_and_is_undefined_for_one_token():
    assert _ok(1, 5, ttft=1.0, e2e=3.0).tpot == pytest.approx(0.5)
    assert _ok(1, 1, ttft=1.0, e2e=1.0).tpot is None
    s = summarize([_ok(1, 5, ttft=1.0, e2e=3.0), _ok(1, 1, ttft=1.0, e2e=1.0)], 3.0)
    assert s.tpot.mean_ms == pytest.approx(500.0)


def test_summary_of_only_failures_has_zero_throughput_and_nan_latencies():
    s = summarize([RequestResult(prompt_len=5, error="boom")], 1.0)
    assert s.completed == 0 and s.output_throughput == 0.0
    assert math.isnan(s.ttft.mean_ms)


def test_non_positive_duration_is_rejected():
    with pytest.raises(ValueError):
        summarize([], 0.0)


def test_stream_timings_give_ttft_and_gaps_between_output_chunks():
    ttft, itl = stream_timings(10.0, [10.5, 10.7, 11.0])
    assert ttft == pytest.approx(0.5)
    assert itl == pytest.approx([0.2, 0.3])


def test_events_that_arrive_in_one_read_have_a_gap_of_zero_and_the_gaps_still_span_the_stream():
    times = [10.5, 10.9, 10.9, 10.9, 10.9, 11.2]  # four events read at once by a client that read late
    ttft, itl = stream_timings(10.0, times)
    assert itl.count(0.0) == 3 and sorted(itl)[len(itl) // 2] == pytest.approx(0.0)
    assert ttft + sum(itl) == pytest.approx(times[-1] - 10.0)


def test_stream_without_output_has_no_ttft():
    with pytest.raises(ValueError):
        stream_timings(0.0, [])


def test_request_json_carries_every_timing():
    row = _ok(7, 3, ttft=0.1, e2e=0.5, itl=[0.2, 0.2]).to_json()
    assert {
        "prompt_len",
        "output_len",
        "ttft",
        "itl",
        "e2e",
        "tpot",
        "start",
        "success",
        "error",
    } <= row.keys()
    assert row["tpot"] == pytest.approx(0.2)
