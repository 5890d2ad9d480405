"""srt behind a real Shepherd Model Gateway (`smg`): two srt workers, one gateway, the `openai` client.

- The gateway recognises srt as an SGLang worker from `/v1/models` alone (no fallback probes), reads its
  sizes from `/server_info` and `/model_info`, its per-replica load from `/v1/loads` in absolute tokens, and
  merges the workers' `/metrics` (`/engine_metrics`).
- A shared-prefix workload through the gateway: every request succeeds; the request and token counters the
  two workers export add up to what the client sent and was answered; the prefix-cache hit rate summed over
  the workers is higher with `--policy cache_aware` than with `round_robin` (printed).
- A worker killed mid-load: its in-flight requests end (an error, never a hang), the gateway routes new
  requests to the survivor, and the survivor's counters match what it served.

Skipped, with the reason, where the `smg` binary (`pip install smg`, a test dependency) cannot run.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from srt.metrics.text_format import parse_metrics_text, select, total
from srt_bench.gateway import (
    CACHE_AWARE,
    ROUND_ROBIN,
    prefix_counters,
    prefix_hit_rate,
    running_gateway,
    shared_prefix_prompts,
    smg_problem,
)
from srt_bench.server import ServerHandle, launch_server, wait_healthy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smg_problem() is not None, reason=str(smg_problem())),
]

MODEL = "SmolLM2-135M-Instruct"
KV_TOKENS = 8192  # a small pool per worker: two workers share this machine
GROUPS, PER_GROUP = 3, 4  # odd: round robin sends each group to both workers
TIMEOUT = 60.0  # per request: a request still open after this has hung
LONG_TOKENS = 64  # in-flight requests of the kill test: still decoding when the worker dies
IN_FLIGHT = 4
# Scheduler counters reach /metrics within about a second of a step (srt/metrics/load_snapshot.py).
SETTLE_SECONDS = 1.5


@pytest.fixture(scope="module")
def workers():
    """Two workers, started side by side."""
    flags = ("--max-total-tokens", str(KV_TOKENS))
    handles = [launch_server(*flags, wait=False) for _ in range(2)]
    try:
        for h in handles:
            wait_healthy(h)
        yield handles
    finally:
        for h in handles:
            h.stop(signal.SIGKILL)
            h.log_path.unlink(missing_ok=True)


def urls(workers: list[ServerHandle]) -> list[str]:
    return [w.base_url for w in workers]


def idle_metrics(*workers: ServerHandle) -> list[str]:
    """Each worker's /metrics once nothing runs or waits on any of them and the schedulers' counters are
    flushed (one settling wait for all of them)."""
    deadline = time.monotonic() + TIMEOUT
    for worker in workers:
        while time.monotonic() < deadline:
            load = httpx.get(f"{worker.base_url}/v1/loads", timeout=5).json()["loads"]
            if all(r["num_running_reqs"] == r["num_waiting_reqs"] == 0 for r in load):
                break
            time.sleep(0.2)
    time.sleep(SETTLE_SECONDS)
    return [httpx.get(f"{worker.base_url}/metrics", timeout=5).text for worker in workers]


def request_counters(metrics_text: str) -> tuple[float, float, float]:
    """(finished requests, prompt tokens, generated tokens) as the worker counts them."""
    s = parse_metrics_text(metrics_text)
    return (
        total(s, "sglang:num_requests_total"),
        total(s, "sglang:prompt_tokens_total"),
        total(s, "sglang:generation_tokens_total"),
    )


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def test_the_gateway_reads_srt_as_an_sglang_worker(workers):
    with running_gateway(urls(workers), CACHE_AWARE, log_level="debug") as gw:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # its load monitor polls each worker's /v1/loads once started
            listed = httpx.get(f"{gw.base_url}/workers", timeout=10).json()["workers"]
            if all("engine_load" in w for w in listed):
                break
            time.sleep(0.2)
        # the gateway merges its workers' /metrics (a strict parser: one label set per family)
        merged = httpx.get(f"{gw.base_url}/engine_metrics", timeout=30)
        logs = gw.logs()
    assert "Detected HTTP backend via /v1/models owned_by: sglang" in logs
    assert "trying fallback" not in logs
    assert sorted(w["url"] for w in listed) == sorted(urls(workers))
    for w in listed:
        assert w["runtime_type"] == "sglang" and w["model_id"] == MODEL
        labels = w["labels"]
        assert labels["max_total_tokens"] == str(KV_TOKENS) and labels["dp_size"] == "1"
        assert labels["context_length"] == labels["max_model_len"] and labels["is_embedding"] == "false"
        assert labels["model_type"] == "llama" and "LlamaForCausalLM" in labels["architectures"]
        (rank,) = w["engine_load"]["loads"]
        assert rank["dp_rank"] == 0 and rank["max_total_num_tokens"] == KV_TOKENS
    assert merged.status_code == 200 and "aggregate_metrics error" not in logs
    addrs = {
        s.labels["worker_addr"] for s in select(parse_metrics_text(merged.text), "sglang:num_requests_total")
    }
    assert addrs == set(urls(workers))


def run_workload(gateway_url: str, prompts: list[str]) -> tuple[int, int]:
    """Send the prompts one after another; every one must succeed. Returns the usage sums."""
    c = client(gateway_url)
    prompt_tokens = completion_tokens = 0
    for p in prompts:
        out = c.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length")
        prompt_tokens += out.usage.prompt_tokens
        completion_tokens += out.usage.completion_tokens
    return prompt_tokens, completion_tokens


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(workers):
    prompts = shared_prefix_prompts(GROUPS, PER_GROUP)
    rates = {}
    for policy in (CACHE_AWARE, ROUND_ROBIN):
        with running_gateway(urls(workers), policy) as gw:
            flushed = httpx.post(f"{gw.base_url}/flush_cache", timeout=30)  # the gateway fans it out
            assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2, flushed.text
            before = idle_metrics(*workers)
            sent_prompt, sent_completion = run_workload(gw.base_url, prompts)
            after = idle_metrics(*workers)
        counted = [
            [a - b for a, b in zip(request_counters(x), request_counters(y), strict=True)]
            for x, y in zip(after, before, strict=True)
        ]
        assert sum(c[0] for c in counted) == len(prompts)
        assert sum(c[1] for c in counted) == sent_prompt
        assert sum(c[2] for c in counted) == sent_completion
        rates[policy] = prefix_hit_rate(list(map(prefix_counters, before)), list(map(prefix_counters, after)))
        print(f"{policy}: prefix-cache hit rate over both workers {rates[policy]:.3f}")
    assert rates[CACHE_AWARE] > rates[ROUND_ROBIN]


def stream_long(gateway_url: str, i: int, outcomes: dict) -> None:
    """One long streamed completion; records `ok` (it finished) or the error that ended it."""
    try:
        stream = client(gateway_url).completions.create(
            model=MODEL, prompt=f"Request {i}: tell a long story.", max_tokens=LONG_TOKENS,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish = None
        for chunk in stream:
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        outcomes[i] = "ok" if finish == "length" else f"ended without finishing ({finish})"
    except (openai.APIError, httpx.HTTPError) as e:
        outcomes[i] = f"{type(e).__name__}: {e}"


def test_a_worker_killed_mid_load_is_routed_around(workers):
    victim, survivor = workers
    with running_gateway(urls(workers), ROUND_ROBIN) as gw:  # round robin: the victim surely has requests
        outcomes: dict[int, str] = {}
        threads = [
            threading.Thread(target=stream_long, args=(gw.base_url, i, outcomes)) for i in range(IN_FLIGHT)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # kill it while it decodes
            load = httpx.get(f"{victim.base_url}/v1/loads", timeout=5).json()["loads"][0]
            if load["num_running_reqs"] > 0:
                break
            time.sleep(0.1)
        victim.stop(signal.SIGKILL)
        for t in threads:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in threads), "a request in flight on the killed worker hung"
        print("in-flight outcomes:", outcomes)
        assert len(outcomes) == IN_FLIGHT
        assert any(o != "ok" for o in outcomes.values()), "no request was in flight on the killed worker"

        [before] = idle_metrics(survivor)
        sent_prompt, sent_completion = run_workload(
            gw.base_url, [f"After the failure {i}:" for i in range(6)]
        )
        [after] = idle_metrics(survivor)
    served = [a - b for a, b in zip(request_counters(after), request_counters(before), strict=True)]
    assert served == [6, sent_prompt, sent_completion]
    assert httpx.get(f"{survivor.base_url}/health", timeout=5).status_code == 200
