"""A real srt server under a known workload: `/metrics` must agree with what the client saw:
exact counts, client vs server, idle, format with promtool and a real Prometheus, log lines)."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from srt.metrics.text_format import Sample, parse_metrics_text, select, total
from srt.sockets import find_free_port
from srt_bench.server import health_probe, start_server
from test.integration.conftest import ServerHandle, launch_server
from test.unit.test_metrics_collectors import promtool_problems

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT = 300.0
STOP_TIMEOUT = 30.0
IDLE_TIMEOUT = 60.0
PROMETHEUS_READY_SECONDS = 60.0
REQUEST_TIMEOUT = 120.0
DECODE_LOG_INTERVAL = 4
SERVER_ARGS = ["--decode-log-interval", str(DECODE_LOG_INTERVAL), "--log-stats-interval", "1",
               "--max-total-tokens", "8192"]  # fmt: skip
# Server-side latencies may not exceed the client's; they may trail them by at most this much per request
# (client-side HTTP parsing on a shared 2-core machine).
CLIENT_SERVER_SLACK_SECONDS = 0.25
DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "srt-dashboard.json"
TIME_RANK = r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d TP0\] "


def metrics_text(server: ServerHandle) -> str:
    r = httpx.get(f"{server.base_url}/metrics", timeout=10)
    r.raise_for_status()
    return r.text


def scrape(server: ServerHandle) -> list[Sample]:
    return parse_metrics_text(metrics_text(server))


def wait_idle(server: ServerHandle, finished_total: float, timeout: float = IDLE_TIMEOUT) -> list[Sample]:
    """Scrape until `finished_total` requests finished and the scheduler reads idle."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(server)
        idle = total(s, "sglang:num_running_reqs") == 0 and total(s, "sglang:num_queue_reqs") == 0
        if idle and total(s, "sglang:num_requests_total") >= finished_total:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError("server did not become idle")
        time.sleep(0.2)


def delta(after: list[Sample], before: list[Sample], name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


# ---------------------------------------------------------------- the workload
class Client:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT)
        self.records: list[dict] = []  # one per HTTP request: usage, n, finish reasons
        self._lock = threading.Lock()

    def _record(self, usage: dict, n: int, reasons: list[str]) -> dict:
        rec = {"usage": usage, "n": n, "reasons": reasons}
        with self._lock:
            self.records.append(rec)
        return rec

    def post(self, path: str, body: dict) -> dict:
        r = self.http.post(path, json={"model": MODEL, **body})
        r.raise_for_status()
        out = r.json()
        self._record(out["usage"], body.get("n", 1), [c["finish_reason"] for c in out["choices"]])
        return out

    def stream(self, path: str, body: dict) -> dict:
        """A streamed request with usage; returns the record plus the client's TTFT and E2E."""
        body = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        ttft = None
        usage, reasons = None, []
        with self.http.stream("POST", path, json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                for c in chunk.get("choices", []):
                    piece = c.get("text") or (c.get("delta") or {}).get("content")
                    if piece and ttft is None:
                        ttft = time.monotonic() - t0
                    if c.get("finish_reason"):
                        reasons.append(c["finish_reason"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
        e2e = time.monotonic() - t0
        rec = self._record(usage, 1, reasons)
        return {**rec, "ttft": ttft, "e2e": e2e}

    def abort_by_disconnect(self, tokens_before_disconnect: int = 2) -> None:
        body = {
            "model": MODEL,
            "prompt": "Count slowly:",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        seen = 0
        with httpx.Client(base_url=str(self.http.base_url), timeout=REQUEST_TIMEOUT) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    seen += 1
                    if seen >= tokens_before_disconnect:
                        break  # leaving the block closes the connection


LONG_PREFIX = " ".join(
    f"Fact {i}: the sky over city number {i} is usually clear in the morning." for i in range(20)
)


# Structured-output requests in the mix: one schema, compiled once; n=2 makes 4 sequences.
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
SO_SEQUENCES = 4


def run_known_workload(client: Client) -> None:
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "ignore_eos": True}
    so = {"max_tokens": 24, "response_format": RESPONSE_FORMAT}
    jobs = [
        lambda: client.stream("/v1/chat/completions", {**chat, "max_tokens": 8}),
        lambda: client.stream("/v1/chat/completions", {**chat, "max_tokens": 7}),
        lambda: client.post("/v1/chat/completions", {**chat, "max_tokens": 6}),
        lambda: client.post("/v1/chat/completions", {**chat, "max_tokens": 5}),
        lambda: client.stream("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 9, "ignore_eos": True}),
        lambda: client.post("/v1/completions", {"prompt": "The capital of France", "max_tokens": 4, "ignore_eos": True}),
        lambda: client.post("/v1/completions", {"prompt": "Roses are", "max_tokens": 5, "n": 2, "temperature": 0.8,
                                                "ignore_eos": True}),
        lambda: client.post("/v1/completions", {"prompt": "One token", "max_tokens": 1, "ignore_eos": True}),
        lambda: client.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Is it ok?"}], **so}),
        lambda: client.stream("/v1/completions", {"prompt": "Is water wet? JSON:", **so}),
        lambda: client.post("/v1/completions", {"prompt": "JSON:", "n": 2, "temperature": 0.8, **so}),
    ]  # fmt: skip
    with ThreadPoolExecutor(max_workers=4) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()
    # Stopped by a stop string: learn the greedy text first, then stop on a piece of its middle.
    probe = {"prompt": "List three fruits:", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = client.post("/v1/completions", probe)["choices"][0]["text"]
    stop = next(
        text[i : i + 3]
        for i in range(4, len(text) - 3)
        if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i
    )
    out = client.post("/v1/completions", {**probe, "stop": [stop]})
    assert out["choices"][0]["finish_reason"] == "stop"
    # Two requests sharing a long prefix, one after the other so the second finds the first's KV.
    for suffix in (" Question one?", " Question two?"):
        client.post("/v1/completions", {"prompt": LONG_PREFIX + suffix, "max_tokens": 3, "ignore_eos": True})


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = launch_server(*SERVER_ARGS, timeout=STARTUP_TIMEOUT)
    yield srv
    srv.stop(timeout=STOP_TIMEOUT)
    srv.log_path.unlink(missing_ok=True)


def test_the_audited_server_runs_the_cpu_default(server):
    """Every figure this module checks against the client is measured with the CPU default's execution (the
    embedded GGUF's int8 made from its blocks, and mixed prefill/decode steps, the other CPU default)."""
    info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()
    assert info["quantization"] == "gguf_int8"


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """A real Prometheus scraping srt every second for the whole workload."""
    if shutil.which("prometheus") is None:
        pytest.skip("needs the Debian package prometheus")
    d = tmp_path_factory.mktemp("prometheus")
    port = find_free_port()
    (d / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: srt\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    command = ["prometheus", f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    handle = start_server(command, port, name="prometheus", log_path=d / "prometheus.log")
    handle.wait_ready(health_probe(handle, "/-/ready"), PROMETHEUS_READY_SECONDS)
    yield handle.base_url
    handle.stop()


@pytest.fixture(scope="module")
def run(server, prometheus):
    """Runs the phases once; each test asserts on what they recorded."""
    client = Client(server.base_url)
    s0 = scrape(server)
    client.abort_by_disconnect()
    s1 = wait_idle(server, total(s0, "sglang:num_requests_total") + 1)
    client.records.clear()
    run_known_workload(client)
    workload = list(client.records)
    sequences = sum(r["n"] for r in workload)
    s2 = wait_idle(server, total(s1, "sglang:num_requests_total") + sequences)
    client.records.clear()
    streamed = [client.stream("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Say {i}."}],
                                                       "max_tokens": 6, "ignore_eos": True}) for i in range(4)]  # fmt: skip
    s3 = wait_idle(server, total(s2, "sglang:num_requests_total") + len(streamed))
    text = metrics_text(server)
    return {"s0": s0, "s1": s1, "s2": s2, "s3": s3, "workload": workload, "streamed": streamed, "text": text}


# ---------------------------------------------------------------- exact counts
def test_token_counters_equal_the_usage_of_the_responses(run):
    s1, s2, w = run["s1"], run["s2"], run["workload"]
    # usage's rule, followed by the counters: each prompt counts once however many samples (n) it has
    assert delta(s2, s1, "sglang:prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for r in w)
    assert delta(s2, s1, "sglang:generation_tokens_total") == sum(r["usage"]["completion_tokens"] for r in w)
    assert delta(s2, s1, "sglang:cached_tokens_total") == sum(
        r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in w
    )


def test_every_finished_request_counted_once_in_each_histogram(run):
    s1, s2, w = run["s1"], run["s2"], run["workload"]
    sequences = sum(r["n"] for r in w)
    assert delta(s2, s1, "sglang:num_requests_total") == sequences
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "time_per_output_token_seconds", "prompt_tokens_histogram", "generation_tokens_histogram",
                 "num_retractions"):  # fmt: skip
        assert delta(s2, s1, f"sglang:{name}_count") == sequences, name
    itl_expected = sum(r["usage"]["completion_tokens"] - r["n"] for r in w)
    assert delta(s2, s1, "sglang:inter_token_latency_seconds_count") == itl_expected


def test_structured_output_requests_are_counted(run):
    s1, s2 = run["s1"], run["s2"]
    assert delta(s2, s1, "sglang:num_so_requests_total") == SO_SEQUENCES
    assert delta(s2, s1, "sglang:grammar_compilation_time_seconds_count") == 1  # one schema, cached
    assert delta(s2, s1, "sglang:num_grammar_cache_hit_total") == SO_SEQUENCES - 1
    assert total(s2, "sglang:num_grammar_queue_reqs") == 0


def test_request_success_by_finish_reason_matches_the_responses(run):
    s1, s2, w = run["s1"], run["s2"], run["workload"]
    for reason in ("stop", "length", "abort", "error"):
        expected = sum(r["reasons"].count(reason) for r in w)
        assert delta(s2, s1, "sglang:request_success_total", finished_reason=reason) == expected, reason


def test_disconnect_counts_as_one_aborted_request(run):
    s0, s1 = run["s0"], run["s1"]
    assert delta(s1, s0, "sglang:num_aborted_requests_total") == 1
    assert delta(s1, s0, "sglang:request_success_total", finished_reason="abort") == 1
    assert delta(s1, s0, "sglang:num_requests_total") == 1
    assert delta(s1, s0, "sglang:time_to_first_token_seconds_count") == 1


def test_shared_prefix_shows_in_cache_counters(run):
    s1, s2 = run["s1"], run["s2"]
    second = run["workload"][-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert second > 0
    assert delta(s2, s1, "sglang:cached_tokens_total") >= second
    assert delta(s2, s1, "sglang:prefix_cache_hits_total") >= second
    assert delta(s2, s1, "sglang:prefix_cache_queries_total") >= delta(
        s2, s1, "sglang:prefix_cache_hits_total"
    )


def test_scheduler_and_process_counters_move(run):
    s3 = run["s3"]
    assert total(s3, "sglang:realtime_tokens_total", mode="prefill_compute") > 0
    assert total(s3, "sglang:realtime_tokens_total", mode="decode") > 0
    assert total(s3, "sglang:forward_seconds_total", mode="decode") > 0
    assert total(s3, "sglang:iteration_tokens_total_count") > 0
    components = {
        s.labels["component"] for s in select(s3, "sglang:process_cpu_seconds_total") if s.value > 0
    }
    assert components == {"tokenizer", "scheduler", "detokenizer"}
    info = select(s3, "sglang:cache_config_info")
    assert len(info) == 1 and info[0].value == 1 and info[0].labels["num_kv_tokens"] == "8192"
    assert float(info[0].labels["max_concurrency"]) > 0
    # the default CPU server: srt's CPU kernels (the GGUF's blocks) keep K/V in float16 (not the model's fp32)
    assert info[0].labels["kv_cache_dtype"] == "float16"
    assert info[0].labels["attention_backend"] == "torch_native"


# ---------------------------------------------------------------- client vs server
def test_server_latencies_never_exceed_the_clients_and_are_close(run):
    s2, s3, streamed = run["s2"], run["s3"], run["streamed"]
    client_ttft = sum(r["ttft"] for r in streamed)
    client_e2e = sum(r["e2e"] for r in streamed)
    server_ttft = delta(s3, s2, "sglang:time_to_first_token_seconds_sum")
    server_e2e = delta(s3, s2, "sglang:e2e_request_latency_seconds_sum")
    slack = CLIENT_SERVER_SLACK_SECONDS * len(streamed)
    assert 0 < server_ttft <= client_ttft
    assert client_ttft - server_ttft < slack
    assert 0 < server_e2e <= client_e2e
    assert client_e2e - server_e2e < slack


# ---------------------------------------------------------------- idle
@pytest.mark.parametrize("phase", ["s1", "s3"])  # s1: right after the aborted request; s3: after everything
def test_idle_gauges_read_zero_as_samples(run, phase):
    s = run[phase]
    for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage", "load_factor"):
        got = select(s, f"sglang:{name}")
        assert [x.value for x in got] == [0.0], name


# ---------------------------------------------------------------- format
@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian package prometheus)")
def test_promtool_accepts_the_exposition(run):
    assert promtool_problems(run["text"]) == []


def test_metrics_content_type_and_no_redirect(server):
    r = httpx.get(f"{server.base_url}/metrics", follow_redirects=False, timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def prom_query(url: str, expr: str) -> dict:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    return r.json()


def test_prometheus_scrapes_srt_and_answers_promql(run, prometheus):
    deadline = time.monotonic() + 30
    while True:  # wait for a scrape taken after the workload
        got = prom_query(prometheus, "sglang:generation_tokens_total")
        series = got.get("data", {}).get("result", [])
        if series and float(series[0]["value"][1]) >= total(run["s3"], "sglang:generation_tokens_total"):
            break
        assert time.monotonic() < deadline, got
        time.sleep(1)
    assert series[0]["metric"]["model_name"] == MODEL
    # rate() needs two samples in its window: Prometheus may have scraped the finished workload only once
    while True:
        q = prom_query(
            prometheus, "histogram_quantile(0.9, rate(sglang:time_to_first_token_seconds_bucket[1m]))"
        )
        assert q["status"] == "success", q
        if q["data"]["result"]:
            break
        assert time.monotonic() < deadline, q
        time.sleep(1)


def test_every_dashboard_query_is_accepted_by_prometheus(run, prometheus):
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    rejected = {}
    for expr in exprs:
        concrete = expr.replace("$__rate_interval", "1m").replace("$model_name", MODEL)
        got = prom_query(prometheus, concrete)
        if got.get("status") != "success":
            rejected[expr] = got.get("error")
    assert rejected == {}


# ---------------------------------------------------------------- log lines
def test_log_lines_match_their_documented_patterns(run, server):
    log = server.logs().splitlines()
    prefill = re.compile(TIME_RANK + r"Prefill batch\. #new-seq: \d+, #new-token: \d+, #cached-token: \d+, "
                         r"token usage: \d+\.\d\d, #running-req: \d+, #queue-req: \d+$")  # fmt: skip
    decode = re.compile(TIME_RANK + r"Decode batch\. #running-req: \d+, #token: \d+, token usage: \d+\.\d\d, "
                        r"gen throughput \(token/s\): \d+\.\d\d, #queue-req: \d+$")  # fmt: skip
    summary = re.compile(TIME_RANK + r"Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: "
                         r"\d+\.\d tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: \d+\.\d%, "
                         r"Prefix cache hit rate: \d+\.\d%$")  # fmt: skip
    for kind, pattern in (
        ("Prefill batch.", prefill),
        ("Decode batch.", decode),
        ("Avg prompt throughput", summary),
    ):
        lines = [line for line in log if kind in line]
        assert lines, f"no {kind!r} line"
        bad = [line for line in lines if not pattern.match(line)]
        assert bad == [], bad[:3]
