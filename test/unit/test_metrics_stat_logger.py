"""The scheduler's log lines match the shapes docs/metrics.md documents in "Log lines" (operators grep for
them)."""

import logging
import re

import pytest

from srt.metrics.stat_logger import (
    GenThroughputMeter,
    PrefixHitWindow,
    SpecDecodingLogger,
    StatsSummaryLogger,
    format_decode_line,
    format_prefill_line,
)
from srt.process_logging import ProcessLogFormatter, rank_label

N = r"\d+"
F2 = r"\d+\.\d\d"
PREFILL_RE = re.compile(
    rf"^Prefill batch\. #new-seq: {N}, #new-token: {N}, #cached-token: {N}, token usage: {F2}, "
    rf"#running-req: {N}, #queue-req: {N}$"
)
DECODE_RE = re.compile(
    rf"^Decode batch\. #running-req: {N}, #token: {N}, token usage: {F2}, "
    rf"gen throughput \(token/s\): {F2}, #queue-req: {N}$"
)
SUMMARY_RE = re.compile(
    r"^Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: \d+\.\d tokens/s, "
    r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: \d+\.\d%, Prefix cache hit rate: \d+\.\d%$"
)


def test_prefill_line_shape_and_values():
    line = format_prefill_line(
        new_seq=3, new_token=120, cached_token=64, token_usage=0.0412, running_req=5, queue_req=2
    )
    assert PREFILL_RE.match(line)
    assert line == (
        "Prefill batch. #new-seq: 3, #new-token: 120, #cached-token: 64, token usage: 0.04, "
        "#running-req: 5, #queue-req: 2"
    )


def test_decode_line_shape_and_values():
    line = format_decode_line(running_req=4, token=1234, token_usage=0.5, gen_throughput=87.456, queue_req=0)
    assert DECODE_RE.match(line)
    assert "gen throughput (token/s): 87.46" in line


def test_summary_logs_vllm_shape_once_per_interval_with_windowed_hit_rate(caplog):
    logger = logging.getLogger("test.summary")
    s = StatsSummaryLogger(interval=10.0, logger=logger, now=0.0)
    s.on_prefill(150, prefix_queries=200, prefix_hits=50, num_requests=2)
    s.on_prefill(50, prefix_queries=0, prefix_hits=0, num_requests=0)
    s.on_decode(50)
    assert s.maybe_log(5.0, running=1, waiting=0, kv_usage=0.1) is None  # interval not over
    with caplog.at_level(logging.INFO, logger="test.summary"):
        line = s.maybe_log(10.0, running=2, waiting=1, kv_usage=0.256)
    assert line is not None and SUMMARY_RE.match(line)
    assert line.startswith("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s")
    assert "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.6%, Prefix cache hit rate: 25.0%" in line
    assert caplog.messages == [line]


def test_summary_without_logger_only_returns_the_line(caplog):
    s = StatsSummaryLogger(interval=1.0, now=0.0)
    s.on_decode(5)
    with caplog.at_level(logging.DEBUG):
        assert s.maybe_log(2.0, running=1, waiting=0, kv_usage=0.0)
    assert caplog.messages == []


def test_summary_is_silent_when_idle():
    s = StatsSummaryLogger(interval=10.0, now=0.0)
    assert s.maybe_log(20.0, running=0, waiting=0, kv_usage=0.0) is None


def test_hit_rate_window_covers_only_the_last_1000_requests():
    w = PrefixHitWindow(max_requests=1000)
    for _ in range(100):
        w.add(10, 100, 100)  # 1000 requests, all hits
    assert w.hit_rate() == 1.0
    for _ in range(100):
        w.add(10, 100, 0)  # 1000 newer requests, all misses
    assert w.hit_rate() == 0.0
    w.add(500, 100, 100)
    assert 0.0 < w.hit_rate() < 1.0


def test_gen_throughput_is_over_the_last_interval_only():
    m = GenThroughputMeter(now=0.0)
    m.add(100)
    assert m.take(now=2.0) == pytest.approx(50.0)
    m.add(30)
    assert m.take(now=5.0) == pytest.approx(10.0)


@pytest.mark.parametrize(("tp", "dp", "tag"), [(0, None, "TP0"), (0, 1, "DP1 TP0")])
def test_a_scheduler_line_starts_with_time_and_rank(tp, dp, tag):
    line = format_prefill_line(
        new_seq=1, new_token=2, cached_token=0, token_usage=0, running_req=1, queue_req=0
    )
    record = logging.LogRecord("srt.scheduler", logging.INFO, __file__, 1, line, None, None)
    out = ProcessLogFormatter(rank_label(tp, dp)).format(record)
    assert re.match(rf"^\[\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d {tag}\] Prefill batch\. ", out)


def test_warnings_also_name_their_level_and_logger():
    record = logging.LogRecord("srt.launch_server", logging.WARNING, __file__, 1, "disk full", None, None)
    out = ProcessLogFormatter("main").format(record)
    assert re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d main\] WARNING srt\.launch_server: disk full$", out)
    record.levelno, record.levelname = logging.INFO, "INFO"
    assert ProcessLogFormatter("main").format(record).endswith("main] disk full")


SPEC_RE = re.compile(
    rf"^SpecDecoding metrics: Mean acceptance length: {F2}, Accepted throughput: {F2} tokens/s, "
    rf"Drafted throughput: {F2} tokens/s, Accepted: {N} tokens, Drafted: {N} tokens, "
    rf"Per-position acceptance rate: \d\.\d{{3}}(, \d\.\d{{3}})*, Avg Draft acceptance rate: \d+\.\d%$"
)


def test_spec_decoding_line_has_vllms_shape_once_per_interval_with_verify_steps():
    spec = SpecDecodingLogger(10.0, max_drafts=3, now=0.0)
    spec.add(2, 5, (2, 1))  # two requests drafted 5 tokens; 2 accepted at position 0, 1 at position 1
    spec.add(1, 3, (1, 1, 1))
    assert spec.maybe_line(now=5.0) is None  # the interval has not passed
    line = spec.maybe_line(now=10.0)
    assert SPEC_RE.match(line), line
    assert "Mean acceptance length: 3.00" in line  # 1 + 6 accepted / 3 drafts
    assert "Accepted: 6 tokens, Drafted: 8 tokens" in line and "Accepted throughput: 0.60 tokens/s" in line
    assert "Per-position acceptance rate: 1.000, 0.667, 0.333" in line and "75.0%" in line
    assert spec.maybe_line(now=20.0) is None  # nothing verified in this interval: no line
