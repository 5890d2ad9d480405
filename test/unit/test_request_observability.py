"""The per-request views without a server: custom-label policy, the request export's files and
drops, the load report's formats and its reader over gauge files, and the timings of a finished record."""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime

import pytest

from srt.child_startup import ConfigError
from srt.http_server.load_report import format_load_report
from srt.metrics.custom_labels import OTHER_VALUE, parse_allowed_custom_labels
from srt.metrics.load_snapshot import LoadSnapshot, SchedulerLoadReader, SchedulerLoadWriter, load_file
from srt.metrics.request_export import RequestExporter, check_export_dir, hourly_file_name
from srt.metrics.request_stats import FinishedRequestStats
from srt.server_args import ServerArgs


# ---------------------------------------------------------------- custom labels
def test_allow_list_syntax_and_resolution():
    policy = parse_allowed_custom_labels(["tenant=a,b", "tier=free"])
    assert policy.names == ("tenant", "tier")
    assert policy.resolve('{"tenant": "a", "tier": "free"}') == ("a", "free")
    assert policy.resolve('{"tenant": "zzz"}') == (OTHER_VALUE, "")  # outside the values: other
    assert policy.resolve('{"region": "eu"}') == ("", "")  # outside the names: dropped
    assert policy.resolve('{"tenant": 1, "tier": null}') == (OTHER_VALUE, "")
    for malformed in ("not json", "[1]", '"a"', "{" * 5000, None, ""):
        assert policy.resolve(malformed) == ("", "")


def test_many_distinct_values_stay_bounded():
    policy = parse_allowed_custom_labels(["tenant=a,b,c"])
    seen = {policy.resolve(json.dumps({"tenant": f"t{i}"})) for i in range(10_000)}
    assert seen == {(OTHER_VALUE,)}


@pytest.mark.parametrize(
    "items", [["tenant"], ["tenant="], ["tenant=a,,b"], ["9x=a"], ["__x=a"], ["le=a"], ["t=a", "t=b"]]
)
def test_bad_allow_lists_fail_at_start_up_with_one_line(items):
    with pytest.raises(ValueError) as info:
        ServerArgs(tokenizer_metrics_allowed_custom_labels=items)
    assert "--tokenizer-metrics-allowed-custom-labels" in str(info.value)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- request export
def test_export_dir_is_checked(tmp_path):
    assert check_export_dir(str(tmp_path / "new")) == str(tmp_path / "new")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        check_export_dir(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="needs --export-metrics-to-file-dir"):
        check_export_dir(None)


def test_lines_go_to_the_file_of_their_utc_hour(tmp_path):
    exporter = RequestExporter(str(tmp_path))
    t1 = datetime(2026, 1, 2, 3, 59, 59, tzinfo=UTC).timestamp()
    t2 = datetime(2026, 1, 2, 4, 0, 1, tzinfo=UTC).timestamp()
    for rid, ts in (("a", t1), ("b", t2), ("c", t2)):
        exporter.submit({"rid": rid, "finish_ts": ts})
    exporter.close()
    assert hourly_file_name(t1) == "requests-2026-01-02-03.jsonl"
    files = {p.name: [json.loads(x)["rid"] for x in p.read_text().splitlines()] for p in tmp_path.iterdir()}
    assert files == {"requests-2026-01-02-03.jsonl": ["a"], "requests-2026-01-02-04.jsonl": ["b", "c"]}


def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path, monkeypatch):
    import srt.metrics.request_export as export

    release = threading.Event()
    real_name = export.hourly_file_name
    monkeypatch.setattr(export, "EXPORT_QUEUE_SIZE", 2)
    monkeypatch.setattr(export, "hourly_file_name", lambda ts: release.wait(10) and real_name(ts))
    exporter = RequestExporter(str(tmp_path))
    for i in range(10):
        exporter.submit({"rid": str(i), "finish_ts": 0.0})  # never blocks, whatever the writer does
    assert exporter.dropped >= 7
    release.set()
    exporter.close()
    written = sum(len(p.read_text().splitlines()) for p in tmp_path.iterdir())
    assert written == 10 - exporter.dropped


# ---------------------------------------------------------------- load reports
def test_load_report_formats():
    load = LoadSnapshot(num_requests_running=3, num_requests_waiting=2, kv_cache_usage_perc=0.25)
    text = format_load_report("text", load)
    assert text == (
        "TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=2.0, "
        "named_metrics.num_requests_running=3.0"
    )
    kind, payload = format_load_report(" JSON ", load).split(" ", 1)
    assert kind == "JSON" and json.loads(payload) == {
        "named_metrics": {
            "kv_cache_usage_perc": 0.25,
            "num_requests_waiting": 2.0,
            "num_requests_running": 3.0,
        }
    }
    assert format_load_report("BIN", load) is None


def test_reader_sums_data_parallel_schedulers_and_caches(tmp_path):
    for rank, running, used in ((0, 2, 100), (1, 1, 300)):
        writer = SchedulerLoadWriter(str(tmp_path), rank)
        writer.write(running=running, waiting=1, used_tokens=used, capacity=1000)
    (tmp_path / "load_9.json").write_text("{")  # being replaced, or not a record: skipped
    now = [0.0]
    reader = SchedulerLoadReader(str(tmp_path), max_age=0.1, clock=lambda: now[0])
    out = [reader.read()]
    os.unlink(load_file(str(tmp_path), 1))
    out.append(reader.read())  # cached
    now[0] = 1.0
    out.append(reader.read())
    out.append(SchedulerLoadReader(str(tmp_path / "none")).read())
    got = [
        None if s is None else [s.num_requests_running, s.num_requests_waiting, s.kv_cache_usage_perc]
        for s in out
    ]
    assert got == [[3, 2, 0.2], [3, 2, 0.2], [2, 1, 0.1], None]


# ---------------------------------------------------------------- the finished record
def test_timings_are_the_record_properties():
    s = FinishedRequestStats(
        prompt_tokens=5, generation_tokens=5, cached_tokens=2, finished_reason="length",
        arrival_ts=100.0, first_token_recv_ts=100.5, finish_recv_ts=101.5, queued_ts=7.0, scheduled_ts=7.25,
        first_token_ts=7.5, last_token_ts=8.5, num_retractions=1, wall_offset=1e9, rid="r",
    )  # fmt: skip
    t = s.timings()
    assert t["e2e_latency"] == s.e2e == 1.5 and t["queue_time"] == s.queue_time == 0.25
    assert t["prefill_latency"] == s.prefill_time and t["inference_time"] == s.inference_time == 1.25
    assert t["decode_throughput"] == 4 / 1.0 == 1 / s.tpot
    assert t["request_received_ts"] == 1e9 + 100.0 and t["response_sent_to_client_ts"] is None
    assert t["total_retractions"] == 1 and t["cached_tokens"] == 2
    line = s.export_record()
    assert line["rid"] == "r" and line["finish_ts"] == 1e9 + 101.5 and line["e2e_latency"] == 1.5
    aborted = FinishedRequestStats(0 + 5, 0, 0, "abort", 100.0, None, 100.1, 7.0, None, None, None)
    assert aborted.timings()["queue_time"] is None and aborted.timings()["decode_throughput"] is None
