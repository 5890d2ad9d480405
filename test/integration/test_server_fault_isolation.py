"""A request that fails inside the scheduler fails alone: with the scheduler's fault-injection test hook on, the
request whose rid matches raises mid-decode; its client gets an OpenAI error object, every concurrent request
gets exactly the text it gets alone, no child process restarts, and the failure is counted once as
`sglang:request_success_total{finished_reason="error"}`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from srt.metrics.text_format import parse_metrics_text, total
from srt.scheduler.fault_isolation import TEST_FAULT_DECODE_STEP, TEST_FAULT_ENV
from test.integration.conftest import launch_server

pytestmark = pytest.mark.slow

FAULT_RID = "poisoned"
PROMPTS = ["The capital of France is", "Count from one to ten:", "Write a haiku about rain.", "Three colors:"]
MAX_NEW_TOKENS = 4 * TEST_FAULT_DECODE_STEP  # the others are still decoding when the fault fires
REQUEST_TIMEOUT = 120.0
ERRORS = ("sglang:request_success_total", {"finished_reason": "error"})


@pytest.fixture(scope="module")
def server():
    srv = launch_server(env={TEST_FAULT_ENV: FAULT_RID})
    yield srv
    srv.stop()


def generate(srv, text: str, rid: str | None = None, stream: bool = False) -> httpx.Response:
    body = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
        "stream": stream,
        **({"rid": rid} if rid else {}),
    }
    return httpx.post(f"{srv.base_url}/generate", json=body, timeout=REQUEST_TIMEOUT)


def errors_counted(srv) -> float:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
    return total(parse_metrics_text(text), ERRORS[0], **ERRORS[1])


def test_a_request_failing_mid_decode_fails_alone(server):
    alone = {}
    for p in PROMPTS:
        r = generate(server, p)
        assert r.status_code == 200, r.text
        alone[p] = r.json()["text"]
    pids = server.child_pids()
    errors_before = errors_counted(server)

    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        clean = [pool.submit(generate, server, p, f"clean-{i}") for i, p in enumerate(PROMPTS)]
        bad = pool.submit(generate, server, PROMPTS[0], f"{FAULT_RID}-1")
        clean_results, bad_result = [f.result() for f in clean], bad.result()

    assert bad_result.status_code == 500, bad_result.text  # a valid request the server failed
    assert bad_result.json()["error"]["type"] == "server_error"
    error = bad_result.json()["error"]
    assert "injected" in error["message"] and error["type"]
    for p, r in zip(PROMPTS, clean_results, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["text"] == alone[p], p
        assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
    assert server.child_pids() == pids
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert errors_counted(server) - errors_before == 1
    assert generate(server, PROMPTS[1]).json()["text"] == alone[PROMPTS[1]]


def test_a_streamed_request_failing_mid_decode_ends_with_an_error_event(server):
    r = generate(server, PROMPTS[2], f"{FAULT_RID}-stream", stream=True)
    assert r.status_code == 200
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"error"' in events[-2] and "injected" in events[-2]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
