"""The collectors in a real multiprocess directory: several writer processes, one aggregating reader, as in
the server. Writers and the reader are fresh interpreters (prometheus_client's mode is per process), so this
test process never imports prometheus_client itself."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from srt.metrics.text_format import metric_types, parse_metrics_text, select, total

ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTEXT_LEN = 2048
CAPACITY = 1000

TOKENIZER_WRITER = """
    from srt.metrics.collector import FinishedRequestStats, TokenizerMetricsCollector, start_process_metrics
    labels = {"model_name": "m"}
    c = TokenizerMetricsCollector(labels, context_len=CONTEXT_LEN)
    start_process_metrics("tokenizer", labels, interval=60)
    c.observe_time_to_first_token(0.05)
    c.observe_inter_token_latencies([0.01, 0.02, 0.03])
    c.observe_finished_request(FinishedRequestStats(
        prompt_tokens=10, generation_tokens=4, cached_tokens=3, finished_reason="length", arrival_ts=0.0,
        first_token_recv_ts=0.05, finish_recv_ts=0.2, queued_ts=5.0, scheduled_ts=5.01, first_token_ts=5.04,
        last_token_ts=5.1, num_retractions=1, max_tokens_param=4, n_param=2))
    c.inc_aborted_requests()
    c.observe_finished_request(FinishedRequestStats(
        prompt_tokens=7, generation_tokens=0, cached_tokens=0, finished_reason="abort", arrival_ts=0.0,
        first_token_recv_ts=None, finish_recv_ts=0.3, queued_ts=5.0, scheduled_ts=None, first_token_ts=None,
        last_token_ts=None, max_tokens_param=16))
"""

SCHEDULER_WRITER = """
    import json, os
    from srt.metrics.collector import (SchedulerMetricsCollector, SchedulerStats, make_cache_config,
        make_metrics_registry, start_process_metrics)
    from srt.metrics.text_format import parse_metrics_text, total
    from prometheus_client import generate_latest
    labels = {"model_name": "m", "tp_rank": "0", "dp_rank": DP_RANK}
    cfg = make_cache_config(page_size=1, max_total_num_tokens=CAPACITY, max_running_requests=8,
        chunked_prefill_size=512, prefix_caching=True, kv_cache_dtype="float32",
        attention_backend="torch_native", context_len=CONTEXT_LEN)
    c = SchedulerMetricsCollector(labels, cfg, CAPACITY, context_len=CONTEXT_LEN)
    start_process_metrics("scheduler", labels, interval=60)
    if FLUSH:
        c.set_startup_times(3.5, 1.25)
        c.on_prefill_batch(2, 30, 10, 40, 10, 0.5)
        c.on_decode_batch(2, 0.01)
        c.on_decode_batch(2, 0.01)
        c.on_prefill_batch(1, 8, 0, 8, 0, 0.25, 3)  # a mixed step: 8 prompt tokens and 3 decoded ones
        c.on_retraction(1)
        c.on_finished_request(prompt_tokens=150, output_tokens=50, cached_tokens=10)
        c.on_finished_request(prompt_tokens=250, output_tokens=150, cached_tokens=0)
        read = lambda: parse_metrics_text(generate_latest(make_metrics_registry()).decode())
        before = total(read(), "sglang:realtime_tokens_total", mode="decode")
        c.flush(SchedulerStats(num_running_reqs=3, num_queue_reqs=2, num_used_tokens=250, token_usage=0.25,
                               gen_throughput=12.5, cache_hit_rate=0.25, new_token_ratio=0.7,
                               kv_headroom_tokens=750))
        after = total(read(), "sglang:realtime_tokens_total", mode="decode")
        print(json.dumps({"pid": os.getpid(), "before_flush": before, "after_flush": after}))
    else:
        print(json.dumps({"pid": os.getpid()}))
"""

READER = """
    import sys
    from prometheus_client import generate_latest
    from srt.metrics.collector import make_metrics_registry
    from srt.metrics.multiprocess import mark_process_dead
    for pid in sys.argv[1:]:
        mark_process_dead(int(pid))
    sys.stdout.write(generate_latest(make_metrics_registry()).decode())
"""


def run(code: str, metrics_dir: str, *args: str, **subst: str) -> str:
    for k, v in {**subst, "CONTEXT_LEN": str(CONTEXT_LEN), "CAPACITY": str(CAPACITY)}.items():
        code = code.replace(k, v)
    env = {**os.environ, ENV: metrics_dir}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory):
    """One tokenizer writer, one scheduler that only started (dp 0), one that worked and flushed (dp 1)."""
    d = str(tmp_path_factory.mktemp("mp"))
    run(TOKENIZER_WRITER, d)
    idle = json.loads(run(SCHEDULER_WRITER, d, DP_RANK='"0"', FLUSH="False"))
    busy = json.loads(run(SCHEDULER_WRITER, d, DP_RANK='"1"', FLUSH="True"))
    return {"dir": d, "idle": idle, "busy": busy}


@pytest.fixture(scope="module")
def exposition(metrics_dir):
    return run(READER, metrics_dir["dir"])


@pytest.fixture(scope="module")
def samples(exposition):
    return parse_metrics_text(exposition)


def test_request_counters_sum_finished_requests(samples):
    assert total(samples, "sglang:prompt_tokens_total") == 17
    assert total(samples, "sglang:generation_tokens_total") == 4
    assert total(samples, "sglang:cached_tokens_total") == 3
    assert total(samples, "sglang:num_requests_total") == 2
    assert total(samples, "sglang:num_aborted_requests_total") == 1
    by_reason = {
        s.labels["finished_reason"]: s.value for s in select(samples, "sglang:request_success_total")
    }
    assert by_reason == {"stop": 0, "length": 1, "abort": 1, "error": 0}


def test_each_finished_request_counted_once_where_its_interval_is_defined(samples):
    count = lambda name: total(samples, f"sglang:{name}_count")  # noqa: E731
    assert count("e2e_request_latency_seconds") == 2
    assert count("prompt_tokens_histogram") == 2
    assert count("num_retractions") == 2
    # the request aborted before scheduling has no queue/prefill/decode/inference/TPOT
    for name in ("queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "time_per_output_token_seconds"):  # fmt: skip
        assert count(name) == 1, name
    assert count("time_to_first_token_seconds") == 1
    assert count("inter_token_latency_seconds") == 3
    assert total(samples, "sglang:inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert total(samples, "sglang:request_decode_time_seconds_sum") == pytest.approx(0.06)
    assert total(samples, "sglang:time_per_output_token_seconds_sum") == pytest.approx(0.02)


def test_histograms_use_the_documented_buckets(samples):
    def bounds(name):
        return [s.labels["le"] for s in select(samples, f"sglang:{name}_bucket")]

    assert bounds("time_to_first_token_seconds")[:3] == ["0.001", "0.005", "0.01"]
    assert "400.0" in bounds("time_to_first_token_seconds")
    assert bounds("request_params_n") == ["1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"]
    assert bounds("num_retractions")[-3:] == ["75.0", "100.0", "+Inf"]
    assert bounds("prompt_tokens_histogram")[-2:] == ["5000.0", "+Inf"]  # 1-2-5 up to the 2048 context


def test_scheduler_gauges_are_zero_initialised_samples(samples):
    for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage", "gen_throughput",
                 "cache_hit_rate", "load_factor"):  # fmt: skip
        got = select(samples, f"sglang:{name}", dp_rank="0")
        assert [s.value for s in got] == [0.0], name


def test_flush_writes_gauges_counters_and_saturation(samples, metrics_dir):
    busy = metrics_dir["busy"]
    assert busy["before_flush"] == 0 and busy["after_flush"] == 7, (
        "per-step numbers reach prometheus at flush"
    )
    g = lambda name: select(samples, f"sglang:{name}", dp_rank="1")[0].value  # noqa: E731
    assert (g("num_running_reqs"), g("num_queue_reqs"), g("num_used_tokens")) == (3, 2, 250)
    assert g("token_usage") == 0.25 and g("gen_throughput") == 12.5 and g("kv_headroom_tokens") == 750
    assert g("max_total_num_tokens") == CAPACITY
    assert g("max_concurrency_estimate") == pytest.approx(CAPACITY / 300)  # mean footprint (200 + 400) / 2
    assert g("load_factor") == pytest.approx(5 / (CAPACITY / 300))
    assert g("engine_startup_time") == 3.5 and g("engine_load_weights_time") == 1.25
    # cold start: no finished request yet, so the worst case (full context) is assumed
    idle_estimate = select(samples, "sglang:max_concurrency_estimate", dp_rank="0")[0].value
    assert idle_estimate == pytest.approx(CAPACITY / CONTEXT_LEN)
    c = lambda name, **kw: total(samples, f"sglang:{name}", dp_rank="1", **kw)  # noqa: E731
    assert c("realtime_tokens_total", mode="prefill_compute") == 30 + 8
    assert c("realtime_tokens_total", mode="prefill_cache") == 10
    assert c("realtime_tokens_total", mode="decode") == 4 + 3
    assert c("prefix_cache_queries_total") == 48 and c("prefix_cache_hits_total") == 10
    assert c("num_retracted_requests_total") == 1
    assert c("forward_seconds_total", mode="extend") == pytest.approx(0.75)  # a mixed step runs as extend
    assert c("forward_seconds_total", mode="decode") == pytest.approx(0.02)
    assert c("iteration_tokens_total_count") == 4 and c("iteration_tokens_total_sum") == 34 + 11


def test_cache_config_info_is_a_gauge_at_one_with_capacity_and_concurrency(samples, exposition):
    info = select(samples, "sglang:cache_config_info", dp_rank="1")
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["num_kv_tokens"] == str(CAPACITY)
    assert info[0].labels["num_pages"] == str(CAPACITY)  # page size 1
    assert float(info[0].labels["max_concurrency"]) == pytest.approx(CAPACITY / CONTEXT_LEN, abs=0.01)
    assert metric_types(exposition)["sglang:cache_config_info"] == "gauge"


def test_every_sample_of_a_metric_has_the_same_label_names(samples):
    """Processes of different kinds write the per-process families; strict parsers (a gateway merging its
    workers' /metrics) refuse a family whose samples have different label sets."""
    names: dict[str, set] = {}
    for s in samples:
        names.setdefault(s.name, set()).add(frozenset(s.labels))
    assert {n: sets for n, sets in names.items() if len(sets) > 1} == {}


def test_every_family_has_model_name_and_process_metrics_have_component(samples):
    sglang = [s for s in samples if s.name.startswith("sglang:")]
    assert sglang and all(s.labels.get("model_name") == "m" for s in sglang)
    components = {s.labels["component"] for s in select(samples, "sglang:process_cpu_seconds_total")}
    assert components == {"tokenizer", "scheduler"}
    assert all(s.value > 0 for s in select(samples, "sglang:process_resident_memory_bytes"))
    assert all(s.value > 0 for s in select(samples, "sglang:process_open_fds"))


def test_dead_scheduler_live_gauges_disappear_but_counters_stay(metrics_dir):
    after = parse_metrics_text(run(READER, metrics_dir["dir"], str(metrics_dir["busy"]["pid"])))
    assert select(after, "sglang:num_running_reqs", dp_rank="1") == []
    assert select(after, "sglang:cache_config_info", dp_rank="1") == []
    assert [s.value for s in select(after, "sglang:num_running_reqs", dp_rank="0")] == [0.0]
    assert total(after, "sglang:realtime_tokens_total", dp_rank="1", mode="decode") == 7


# promtool's lint rejects names srt keeps for SGLang/vLLM compatibility (docs/metrics.md, "Names"): the
# `sglang:` prefix (colons are meant for recording rules), SGLang's `*_tokens_histogram` and vLLM's
# histogram `iteration_tokens_total`. Only those exact findings are accepted; anything else fails.
COLON_LINT = "metric names should not contain ':'"
PROMTOOL_ACCEPTED_LINES = {
    "sglang:prompt_tokens_histogram metric name should not include type 'histogram'",
    "sglang:generation_tokens_histogram metric name should not include type 'histogram'",
    'sglang:iteration_tokens_total non-counter metrics should not have "_total" suffix',
}


def promtool_problems(exposition: str) -> list[str]:
    r = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True)
    lines = (r.stdout + r.stderr).splitlines()
    problems = [
        ln for ln in lines if ln.strip() and not ln.endswith(COLON_LINT) and ln not in PROMTOOL_ACCEPTED_LINES
    ]
    if r.returncode not in (0, 3):  # 3 = lint findings only; anything else is a parse failure
        problems.append(f"promtool exit code {r.returncode}")
    return problems


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed"
)
def test_promtool_finds_nothing_beyond_the_sglang_naming(exposition):
    assert promtool_problems(exposition) == []


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed"
)
def test_promtool_filter_still_catches_real_problems():
    broken = '# HELP x_total a\n# TYPE x_total counter\nx_total 1\n# TYPE y gauge\ny{a="1"} 1\n'
    assert promtool_problems(broken)  # no HELP for y
