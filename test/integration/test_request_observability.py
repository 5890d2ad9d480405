"""The per-request views against one real server: per-request timings in responses equal what
`/metrics` observed and what the request export wrote, custom labels stay bounded, and load reports answer
in vLLM's header format."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from srt.metrics.text_format import Sample, parse_metrics_text, select, total
from test.integration.conftest import ServerHandle, running_server

pytestmark = pytest.mark.slow

TIMEOUT = 60.0
EXPORT_WAIT_SECONDS = 10.0
# Timing field -> the histogram whose one observation it must equal (SGLang's names, srt's families).
OBSERVED = {
    "e2e_latency": "sglang:e2e_request_latency_seconds",
    "time_to_first_token": "sglang:time_to_first_token_seconds",
    "queue_time": "sglang:queue_time_seconds",
    "prefill_latency": "sglang:request_prefill_time_seconds",
    "decode_latency": "sglang:request_decode_time_seconds",
    "inference_time": "sglang:request_inference_time_seconds",
    "time_per_output_token": "sglang:time_per_output_token_seconds",
}
# Every field of a response's timings (docs/observability.md, "Per-request timings").
TIMING_FIELDS = (
    *OBSERVED,
    "decode_throughput",
    "cached_tokens",
    "total_retractions",
    "request_received_ts",
    "response_sent_to_client_ts",
)
ALLOWED_TENANTS = {"a", "b"}


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def server(export_dir) -> ServerHandle:
    flags = (
        "--export-metrics-to-file",
        "--export-metrics-to-file-dir",
        str(export_dir),
        "--tokenizer-metrics-allowed-custom-labels",
        "tenant=a,b",
    )
    with running_server(*flags) as handle:
        yield handle


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client:
        yield client


def scrape(http: httpx.Client) -> list[Sample]:
    return parse_metrics_text(http.get("/metrics").text)


def exported(export_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(export_dir.glob("requests-*.jsonl")) for line in f.open()]


def wait_exported(export_dir: Path, rid: str) -> dict:
    deadline = time.monotonic() + EXPORT_WAIT_SECONDS
    while time.monotonic() < deadline:
        lines = [x for x in exported(export_dir) if x["rid"] == rid]
        if lines:
            assert len(lines) == 1, lines
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(f"request {rid} was not exported")


def generate(http, rid: str) -> tuple[dict, float]:
    body = {
        "text": "Hello, my name is",
        "rid": rid,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    }
    start = time.monotonic()
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"], time.monotonic() - start


def chat(http, rid: str) -> tuple[dict, float]:
    body = {
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.monotonic()
    r = http.post("/v1/chat/completions", json=body | {"rid": rid, "return_timing": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["timing"], time.monotonic() - start


def streamed_completion(http, rid: str) -> tuple[dict, float]:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.monotonic()
    with http.stream("POST", "/v1/completions", json=body | {"rid": rid, "return_timing": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    elapsed = time.monotonic() - start
    (final,) = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert all("timing" not in c for e in events for c in e["choices"] if c["finish_reason"] is None)
    return final["timing"], elapsed


@pytest.mark.parametrize("send", [generate, chat, streamed_completion])
def test_timings_equal_the_metrics_observation_and_the_export(http, export_dir, send):
    before = scrape(http)
    rid = f"timing-{send.__name__}"
    timing, client_seconds = send(http, rid)
    after = scrape(http)
    assert total(after, "sglang:num_requests_total") - total(before, "sglang:num_requests_total") == 1
    for field, family in OBSERVED.items():
        count = total(after, f"{family}_count") - total(before, f"{family}_count")
        observed = total(after, f"{family}_sum") - total(before, f"{family}_sum")
        assert count == 1, field
        assert timing[field] == pytest.approx(observed, rel=1e-9, abs=1e-9), field
    assert 0 < timing["e2e_latency"] <= client_seconds
    assert timing["time_to_first_token"] <= timing["e2e_latency"]
    assert timing["decode_throughput"] == pytest.approx(1 / timing["time_per_output_token"])
    assert timing["request_received_ts"] <= timing["response_sent_to_client_ts"] <= time.time()
    assert timing["total_retractions"] == 0

    line = wait_exported(export_dir, rid)
    assert {k: line[k] for k in TIMING_FIELDS} == {k: timing[k] for k in TIMING_FIELDS}  # the very same
    assert line["finish_reason"] == "length" and line["completion_tokens"] == 4
    assert line["params"]["max_new_tokens"] == 4 and line["params"]["temperature"] == 0


def test_health_checks_are_not_exported(http, export_dir):
    before = len(exported(export_dir))
    assert http.get("/health_generate").status_code == 200
    generate(http, "after-health-check")
    wait_exported(export_dir, "after-health-check")
    assert len(exported(export_dir)) == before + 1


@pytest.mark.parametrize("value", [1, "yes", [True]])
def test_return_timing_must_be_a_boolean(http, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "return_timing": value}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_timing"


def test_custom_labels_stay_within_the_allow_list(http):
    headers = [{"tenant": "a"}, {"tenant": "b"}, {"tier": "gold"}]
    headers += [{"tenant": f"t{i}"} for i in range(12)] + [{"tenant": 7}]
    raw = [json.dumps(h) for h in headers] + ["not json", "[1]", "{" * 5000]
    for value in raw:
        body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
        assert http.post("/v1/completions", json=body, headers={"x-custom-labels": value}).status_code == 200
    samples = scrape(http)
    for family in ("sglang:num_requests_total", "sglang:e2e_request_latency_seconds_count"):
        seen = {s.labels["tenant"] for s in select(samples, family)}
        assert seen <= ALLOWED_TENANTS | {"", "other"}
        assert {"a", "b", "other"} <= seen
    assert total(samples, "sglang:num_requests_total", tenant="other") >= 13


def test_load_report_in_vllm_header_format(http):
    body = {"prompt": "Hi", "max_tokens": 1}
    text = http.post("/v1/completions", json=body, headers={"endpoint-load-metrics-format": "TEXT"})
    report = text.headers["endpoint-load-metrics"]
    assert report.startswith("TEXT ")
    metrics = dict(item.split("=") for item in report[5:].split(", "))
    assert set(metrics) == {
        "named_metrics.kv_cache_usage_perc",
        "named_metrics.num_requests_waiting",
        "named_metrics.num_requests_running",
    }
    assert 0 <= float(metrics["named_metrics.kv_cache_usage_perc"]) <= 1
    r = http.post(
        "/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
        headers={"endpoint-load-metrics-format": "json"},
    )
    kind, payload = r.headers["endpoint-load-metrics"].split(" ", 1)
    assert kind == "JSON" and set(json.loads(payload)["named_metrics"]) == {
        k.removeprefix("named_metrics.") for k in metrics
    }
    for asked in ({"endpoint-load-metrics-format": "BIN"}, {}):
        r = http.post("/v1/completions", json=body, headers=asked)
        assert r.status_code == 200 and "endpoint-load-metrics" not in r.headers
