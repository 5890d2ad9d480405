"""Parsing `/metrics` and turning two scrapes into the server's account of one benchmark run."""

import pytest

from srt_bench.prom import ServerView, delta, histogram_mean, parse_metrics


def exposition(ttft_sum, ttft_count, prompt_tokens, queue_count=0, extra=""):
    return f"""# HELP sglang:time_to_first_token_seconds Time to first token.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="m",tp_rank="0"}} 1.0
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m",tp_rank="0"}} {ttft_count}
sglang:time_to_first_token_seconds_sum{{model_name="m",tp_rank="0"}} {ttft_sum}
sglang:time_to_first_token_seconds_count{{model_name="m",tp_rank="0"}} {ttft_count}
# HELP sglang:queue_time_seconds Queue time.
# TYPE sglang:queue_time_seconds histogram
sglang:queue_time_seconds_sum{{model_name="m"}} {queue_count * 0.5}
sglang:queue_time_seconds_count{{model_name="m"}} {queue_count}
# HELP sglang:prompt_tokens_total Prompt tokens.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{model_name="m",dp_rank="0"}} {prompt_tokens}
sglang:prompt_tokens_total{{model_name="m",dp_rank="1"}} 1.0
{extra}"""


def test_samples_are_summed_over_label_sets_and_buckets_dropped():
    snap = parse_metrics(exposition(ttft_sum=2.0, ttft_count=4, prompt_tokens=100))
    assert snap["sglang:prompt_tokens_total"] == 101.0
    assert snap["sglang:time_to_first_token_seconds_count"] == 4.0
    assert not any(name.endswith("_bucket") for name in snap)


def test_run_figures_are_after_minus_before():
    before = parse_metrics(exposition(ttft_sum=2.0, ttft_count=4, prompt_tokens=100))
    after = parse_metrics(exposition(ttft_sum=5.0, ttft_count=10, prompt_tokens=400, queue_count=6))
    d = delta(before, after)
    assert d["sglang:prompt_tokens_total"] == 300.0
    # earlier traffic (4 requests, 2 s) does not leak into the run's mean: 3 s over 6 requests
    assert histogram_mean(d, "sglang:time_to_first_token_seconds") == pytest.approx(0.5)


def test_histogram_without_new_observations_has_no_mean():
    snap = parse_metrics(exposition(ttft_sum=2.0, ttft_count=4, prompt_tokens=1))
    assert histogram_mean(delta(snap, snap), "sglang:time_to_first_token_seconds") is None


def test_server_view_reads_the_metrics_the_benchmark_prints():
    before = parse_metrics(exposition(1.0, 2, 10))
    extra = """# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 640.0
"""
    after = parse_metrics(exposition(4.0, 8, 2058, queue_count=6, extra=extra))
    view = ServerView.from_delta(delta(before, after))
    assert view.ttft_mean == pytest.approx(0.5)
    assert view.queue_mean == pytest.approx(0.5)
    assert view.prompt_tokens == 2048.0
    assert view.generation_tokens == 640.0  # first seen after the run: counted from zero
    assert view.e2e_mean is None and view.requests is None
