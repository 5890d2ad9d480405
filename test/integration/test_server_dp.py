"""`--dp-size 2`: two scheduler replicas behind one HTTP server. Requests are spread over both, the output
is the same as with one replica, and every replica's metrics carry its own `dp_rank`."""

from __future__ import annotations

import time

import httpx
import pytest

from srt.metrics.text_format import parse_metrics_text, select, total
from test.integration.conftest import running_server

pytestmark = pytest.mark.slow

PROMPTS = [f"Request number {i} says" for i in range(6)]
# How often /metrics is read while the scheduler may still add the last step's counts (it flushes them when
# it goes idle), and for how long at most.
SETTLE_POLL_SECONDS = 0.2
SETTLE_LIMIT_SECONDS = 30.0


@pytest.fixture(scope="module")
def two(tiny_model_dir):
    """One server of two replicas for the module's cases (a start costs tens of seconds on 2 cores); each
    case counts the work its own requests did."""
    with running_server("--model-path", tiny_model_dir, "--dp-size", "2") as handle:
        yield handle


def decode_tokens(server) -> dict[str, float]:
    """Decoded tokens by replica, once the counts stop changing (the last step's come when it is idle)."""
    deadline = time.monotonic() + SETTLE_LIMIT_SECONDS
    last = None
    while True:
        samples = parse_metrics_text(httpx.get(f"{server.base_url}/metrics").text)
        now = {r: total(samples, "sglang:realtime_tokens_total", mode="decode", dp_rank=r) for r in "01"}
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(SETTLE_POLL_SECONDS)


def greedy_texts(server) -> list[str]:
    client = server.openai_client()
    model = client.models.list().data[0].id
    return [
        client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in PROMPTS
    ]


def test_two_replicas_share_the_work_and_agree_with_one(tiny_model_dir, two):
    with running_server("--model-path", tiny_model_dir) as one:
        expected = greedy_texts(one)
    before = decode_tokens(two)
    assert greedy_texts(two) == expected
    after = decode_tokens(two)
    samples = parse_metrics_text(httpx.get(f"{two.base_url}/metrics").text)
    for rank in ("0", "1"):
        # round robin: each replica decoded for half the requests
        assert after[rank] > before[rank], f"dp_rank {rank} did no work"
        assert select(samples, "sglang:num_running_reqs", dp_rank=rank), f"no gauge for dp_rank {rank}"
    assert len([n for n in two.child_pids() if n.startswith("srt-scheduler")]) == 2


def test_data_parallel_rank_picks_the_replica_and_loads_report_each(two):
    """A gateway routing over replicas (SMG's --dp-aware) names one in `data_parallel_rank`: every request
    naming rank 1 runs there, whatever the router would choose; a rank out of range, or not an integer, is a
    400 naming the field. `/v1/loads` has one entry per replica, in absolute tokens."""
    before = decode_tokens(two)
    for body in (
        {"prompt": "Pinned", "max_tokens": 3, "data_parallel_rank": 1},
        {"messages": [{"role": "user", "content": "Pinned"}], "max_tokens": 3, "data_parallel_rank": 1},
    ):
        route = "chat/completions" if "messages" in body else "completions"
        for _ in range(3):
            assert httpx.post(f"{two.base_url}/v1/{route}", json=body, timeout=60).status_code == 200
    native = {"text": "Pinned", "sampling_params": {"max_new_tokens": 3}, "data_parallel_rank": 1}
    assert httpx.post(f"{two.base_url}/generate", json=native, timeout=60).status_code == 200
    after = decode_tokens(two)
    assert after["0"] == before["0"]
    assert after["1"] > before["1"]
    for bad in (2, -1, True, "1", 1.0):
        r = httpx.post(
            f"{two.base_url}/v1/completions", json={"prompt": "x", "data_parallel_rank": bad}, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_rank", (bad, r.text)
    loads = httpx.get(f"{two.base_url}/v1/loads", params={"include": "core,queues,memory"}).json()
    assert loads["dp_rank_count"] == 2 and [r["dp_rank"] for r in loads["loads"]] == [0, 1]
    assert all(
        isinstance(r["max_total_num_tokens"], int) and r["max_total_num_tokens"] > 0 for r in loads["loads"]
    )
    bad_section = httpx.get(f"{two.base_url}/v1/loads", params={"include": "core,gpu"})
    assert bad_section.status_code == 400 and bad_section.json()["error"]["param"] == "include"
