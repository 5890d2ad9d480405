"""`--dp-size 2`: two scheduler replicas behind one HTTP server. Requests are spread over both, the output
is the same as with one replica, and every replica's metrics carry its own `dp_rank`."""

from __future__ import annotations

import httpx
import pytest

from srt.metrics.text_format import parse_metrics_text, select, total
from test.integration.conftest import running_server

pytestmark = pytest.mark.slow

PROMPTS = [f"Request number {i} says" for i in range(6)]


def greedy_texts(server) -> list[str]:
    client = server.openai_client()
    model = client.models.list().data[0].id
    return [
        client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in PROMPTS
    ]


def test_two_replicas_share_the_work_and_agree_with_one(tiny_model_dir):
    with running_server("--model-path", tiny_model_dir) as one:
        expected = greedy_texts(one)
    with running_server("--model-path", tiny_model_dir, "--dp-size", "2") as two:
        assert greedy_texts(two) == expected
        samples = parse_metrics_text(httpx.get(f"{two.base_url}/metrics").text)
        for rank in ("0", "1"):
            # round robin: each replica decoded for half the requests
            decoded = total(samples, "sglang:realtime_tokens_total", mode="decode", dp_rank=rank)
            assert decoded > 0, f"dp_rank {rank} did no work"
            assert select(samples, "sglang:num_running_reqs", dp_rank=rank), f"no gauge for dp_rank {rank}"
        assert len([n for n in two.child_pids() if n.startswith("srt-scheduler")]) == 2


def test_data_parallel_rank_picks_the_replica_and_loads_report_each(tiny_model_dir):
    """A gateway routing over replicas (SMG's --dp-aware) names one in `data_parallel_rank`: every request
    naming rank 1 runs there, whatever the router would choose; a rank out of range, or not an integer, is a
    400 naming the field. `/v1/loads` has one entry per replica, in absolute tokens."""
    with running_server("--model-path", tiny_model_dir, "--dp-size", "2") as two:
        for body in (
            {"prompt": "Pinned", "max_tokens": 3, "data_parallel_rank": 1},
            {"messages": [{"role": "user", "content": "Pinned"}], "max_tokens": 3, "data_parallel_rank": 1},
        ):
            route = "chat/completions" if "messages" in body else "completions"
            for _ in range(3):
                assert httpx.post(f"{two.base_url}/v1/{route}", json=body, timeout=60).status_code == 200
        native = {"text": "Pinned", "sampling_params": {"max_new_tokens": 3}, "data_parallel_rank": 1}
        assert httpx.post(f"{two.base_url}/generate", json=native, timeout=60).status_code == 200
        samples = parse_metrics_text(httpx.get(f"{two.base_url}/metrics").text)
        assert total(samples, "sglang:realtime_tokens_total", mode="decode", dp_rank="0") == 0
        assert total(samples, "sglang:realtime_tokens_total", mode="decode", dp_rank="1") > 0
        for bad in (2, -1, True, "1", 1.0):
            r = httpx.post(
                f"{two.base_url}/v1/completions", json={"prompt": "x", "data_parallel_rank": bad}, timeout=60
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_rank", (bad, r.text)
        loads = httpx.get(f"{two.base_url}/v1/loads", params={"include": "core,queues,memory"}).json()
        assert loads["dp_rank_count"] == 2 and [r["dp_rank"] for r in loads["loads"]] == [0, 1]
        assert all(
            isinstance(r["max_total_num_tokens"], int) and r["max_total_num_tokens"] > 0
            for r in loads["loads"]
        )
        bad_section = httpx.get(f"{two.base_url}/v1/loads", params={"include": "core,gpu"})
        assert bad_section.status_code == 400 and bad_section.json()["error"]["param"] == "include"
