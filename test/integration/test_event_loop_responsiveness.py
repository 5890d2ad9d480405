"""Huge requests cannot stall the HTTP process. While normal chat traffic runs, a 50 MB
body (over --max-request-bytes: 413) and a 5 MB prompt (over the character bound: 400) arrive together;
/health and a small normal request keep answering.

Judged against a baseline measured in the same run, never an absolute time (a loaded machine slows both
periods alike): under the huge requests, /health's p99 (a stalled event loop shows as one slow sample) and
the small request's median stay within `STALL_FACTOR` of the small request's median under normal traffic
alone (/health also within what decoding the 5 MB prompt holds the GIL for: `GIL_HOLD_ALLOWANCE`). The small request's p99 is printed, not judged: from ten samples it is the maximum, which one busy
moment of a loaded machine sets (2.45 s once against a 1.0 s limit; 5.2 s within the baseline itself
while other work ran). The figures are printed (`pytest -s`) and put in the assertion message.
"""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import pytest

from test.integration.conftest import API_KEY, ServerHandle, running_server

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
# The limit sits between the two sizes: the 50 MB body is over it, the 5 MB prompt is not (it fails later,
# on the character bound derived from the context length).
MAX_REQUEST_BYTES = 16 * MIB
BIG_BODY_BYTES = 50 * 1000 * 1000
BIG_PROMPT_CHARS = 5 * 1000 * 1000
# The pair is sent this many times, back to back, to cover a measurable period.
BIG_ROUNDS = 3
TRAFFIC_LOOPS = 2
MIN_HEALTH_PROBES = 40
MIN_REQUEST_PROBES = 10
PROBE_INTERVAL_SECONDS = 0.05
# How much slower than under normal traffic alone a statistic may be under the huge requests.
STALL_FACTOR = 3.0
# /health may also wait this many times what decoding the 5 MB prompt's body takes in this process, measured
# in the same run: the C JSON decoder holds the GIL for a whole string value, so the worker thread that
# parses such a body holds the event loop for that long, whatever thread it runs on (8 ms quiet on a 2-core
# Xeon, 30-60 ms under the suite's load; the stalls this test is for were 260-430 ms).
GIL_HOLD_ALLOWANCE = 3.0
HTTP_TIMEOUT_SECONDS = 60.0
BIG_TIMEOUT_SECONDS = 180.0
# Probing stops this long after the start at the latest, whatever the counts.
PERIOD_LIMIT_SECONDS = 300.0
# Normal traffic alone is measured first, for at least this long and until it has MIN_REQUEST_PROBES small
# requests (within PERIOD_LIMIT_SECONDS): the yardstick of the assertions.
WARMUP_SECONDS = 1.0
BASELINE_SECONDS = 3.0

MSGS = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server():
    with running_server("--max-request-bytes", str(MAX_REQUEST_BYTES), api_key=API_KEY) as handle:
        yield handle


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile, q in (0, 100]."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class Probe(threading.Thread):
    """Times one kind of call in a loop; samples are (start, seconds), failures are kept as messages."""

    def __init__(self, server: ServerHandle, name: str, call, interval: float):
        super().__init__(daemon=True, name=name)
        self.server, self.call, self.interval = server, call, interval
        self.samples: list[tuple[float, float]] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(
            base_url=self.server.base_url, headers=self.server.headers, timeout=HTTP_TIMEOUT_SECONDS
        ) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    r = self.call(client)
                    if r.status_code != 200:
                        self.failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.samples.append((start, time.monotonic() - start))
                self.stop.wait(self.interval)

    def between(self, t0: float, t1: float = math.inf) -> list[float]:
        return [seconds for start, seconds in self.samples if t0 <= start < t1]


def health(client: httpx.Client) -> httpx.Response:
    return client.get("/health")


def small_chat(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})


def traffic_chat(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8})


def send_big(server: ServerHandle, path: str, content: bytes) -> tuple[int | str, str]:
    """(status, body excerpt), or ("transport error", the exception) if no answer came back."""
    headers = {**server.headers, "content-type": "application/json"}
    try:
        r = httpx.post(server.base_url + path, content=content, headers=headers, timeout=BIG_TIMEOUT_SECONDS)
    except httpx.HTTPError as e:
        return "transport error", repr(e)
    return r.status_code, r.text[:300]


def decode_time(body: bytes) -> float:
    start = time.perf_counter()
    json.loads(body)
    return time.perf_counter() - start


def summary(name: str, samples: list[float]) -> str:
    if not samples:
        return f"{name}: no samples"
    return (
        f"{name}: n={len(samples)} p50={percentile(samples, 50) * 1000:.0f} ms "
        f"p99={percentile(samples, 99) * 1000:.0f} ms max={max(samples) * 1000:.0f} ms"
    )


def test_health_and_small_requests_stay_fast_under_huge_requests(server):
    body_50mb = json.dumps({"messages": [{"role": "user", "content": "x" * BIG_BODY_BYTES}]}).encode()
    prompt_5mb = json.dumps({"prompt": "hello " * (BIG_PROMPT_CHARS // 6), "max_tokens": 1}).encode()
    assert len(body_50mb) > MAX_REQUEST_BYTES > len(prompt_5mb)

    traffic = [Probe(server, f"traffic-{i}", traffic_chat, 0.0) for i in range(TRAFFIC_LOOPS)]
    health_probe = Probe(server, "health-probe", health, PROBE_INTERVAL_SECONDS)
    request_probe = Probe(server, "request-probe", small_chat, PROBE_INTERVAL_SECONDS)
    probes = [*traffic, health_probe, request_probe]
    for p in probes:
        p.start()
    results: dict[str, list] = {"50 MB body": [], "5 MB prompt": []}

    def big_sender(name: str, path: str, content: bytes) -> threading.Thread:
        t = threading.Thread(
            target=lambda: results[name].append(send_big(server, path, content)), daemon=True
        )
        t.start()
        return t

    try:
        time.sleep(WARMUP_SECONDS)
        while (
            not request_probe.samples and not request_probe.failures
        ):  # the first request's costs are no baseline
            time.sleep(PROBE_INTERVAL_SECONDS)
        t_baseline = time.monotonic()
        time.sleep(BASELINE_SECONDS)
        while (
            len(request_probe.between(t_baseline)) < MIN_REQUEST_PROBES
            and time.monotonic() - t_baseline < PERIOD_LIMIT_SECONDS
        ):
            time.sleep(PROBE_INTERVAL_SECONDS)
        decode_seconds = min(decode_time(prompt_5mb) for _ in range(3))  # at the same load as the period
        t0 = time.monotonic()
        for _ in range(BIG_ROUNDS):
            senders = [
                big_sender("50 MB body", "/v1/chat/completions", body_50mb),
                big_sender("5 MB prompt", "/v1/completions", prompt_5mb),
            ]
            for t in senders:
                t.join(BIG_TIMEOUT_SECONDS)
        while time.monotonic() - t0 < PERIOD_LIMIT_SECONDS and (
            len(health_probe.between(t0)) < MIN_HEALTH_PROBES
            or len(request_probe.between(t0)) < MIN_REQUEST_PROBES
        ):
            time.sleep(PROBE_INTERVAL_SECONDS)
        period = time.monotonic() - t0
    finally:
        for p in probes:
            p.stop.set()
        for p in probes:
            p.join(HTTP_TIMEOUT_SECONDS)

    health_latencies, request_latencies = health_probe.between(t0), request_probe.between(t0)
    baseline = request_probe.between(t_baseline, t0)
    report = (
        f"over {period:.1f} s with {BIG_ROUNDS} x (50 MB body + 5 MB prompt): "
        f"{summary('/health', health_latencies)}; {summary('small chat request', request_latencies)} "
        f"(normal traffic alone: {summary('/health', health_probe.between(t_baseline, t0))}; "
        f"{summary('small chat request', request_probe.between(t_baseline, t0))}; "
        f"the 5 MB prompt's body decodes here in {decode_seconds * 1000:.0f} ms)"
    )
    print(f"\n[event loop] {report}")

    assert [status for status, _ in results["50 MB body"]] == [413] * BIG_ROUNDS, results["50 MB body"]
    assert [status for status, _ in results["5 MB prompt"]] == [400] * BIG_ROUNDS, results["5 MB prompt"]
    for p in probes:
        assert not p.failures, f"{p.name}: {p.failures[:3]}"
    assert len(health_latencies) >= MIN_HEALTH_PROBES, report
    assert len(baseline) >= MIN_REQUEST_PROBES, report
    typical = STALL_FACTOR * percentile(baseline, 50)
    held = typical + GIL_HOLD_ALLOWANCE * decode_seconds
    assert percentile(health_latencies, 99) <= held, f"limit {held * 1000:.0f} ms: {report}"
    assert percentile(request_latencies, 50) <= typical, f"limit {typical * 1000:.0f} ms: {report}"
