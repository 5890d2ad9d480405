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
