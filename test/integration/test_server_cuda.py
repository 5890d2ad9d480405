"""A real srt server on a GPU (skipped without CUDA): the `openai` client gets chat and completion answers,
streamed and not, from a random-weight model of SmolLM2's shape in bf16 with the Triton backend and decode
CUDA graphs, and `/metrics` agrees with what the client counted."""

from __future__ import annotations

import time

import httpx
import pytest

from srt.metrics.text_format import parse_metrics_text, select, total
from test.integration.conftest import running_server

pytestmark = [pytest.mark.cuda, pytest.mark.slow]
IDLE_TIMEOUT_SECONDS = 30.0


def scrape(server) -> list:
    r = httpx.get(f"{server.base_url}/metrics", timeout=10)
    r.raise_for_status()
    return parse_metrics_text(r.text)


def scrape_when_finished(server, finished: int) -> list:
    deadline = time.monotonic() + IDLE_TIMEOUT_SECONDS
    while True:
        samples = scrape(server)
        if total(samples, "sglang:num_requests_total") >= finished:
            return samples
        assert time.monotonic() < deadline, "the server never counted every request"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(smollm2_shaped_model_dir):
    with running_server(
        "--model-path", smollm2_shaped_model_dir, "--device", "cuda", "--enable-metrics"
    ) as srv:
        yield srv


def test_the_server_runs_bf16_triton_with_cuda_graphs(server):
    info = select(scrape(server), "sglang:cache_config_info")
    assert len(info) == 1
    assert info[0].labels["attention_backend"] == "triton"
    assert info[0].labels["kv_cache_dtype"] == "bfloat16"
    assert "decode CUDA graphs up to batch" in server.logs()


def test_openai_answers_and_metrics_agree_with_the_client(server):
    client = server.openai_client(timeout=60)
    model = client.models.list().data[0].id  # the served name: the model directory's
    usages = []
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=16,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 16
    usages.append(chat.usage)
    comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.7)
    assert comp.choices[0].text and comp.usage.completion_tokens <= 8
    usages.append(comp.usage)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count."}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 12 and text
    usages.append(chunks[-1].usage)
    # the greedy chat again: the same tokens from the prefix cache and a graph-replayed decode
    again = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=16,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert again.choices[0].message.content == chat.choices[0].message.content
    usages.append(again.usage)

    samples = scrape_when_finished(server, len(usages))
    assert total(samples, "sglang:num_requests_total") == len(usages)
    assert total(samples, "sglang:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert total(samples, "sglang:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert total(samples, "sglang:forward_seconds_total", mode="decode") > 0
    assert total(samples, "sglang:e2e_request_latency_seconds_count") == len(usages)
