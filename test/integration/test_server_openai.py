"""The OpenAI-compatible and native HTTP surface of a real server, through the real `openai` client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from test.integration.conftest import API_KEY

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colors of the rainbow."}]
MODEL = "SmolLM2-135M-Instruct"
GREEDY = dict(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def client(default_server):
    return default_server.openai_client(timeout=120)


@pytest.fixture(scope="module")
def tokenizer(default_server):
    from transformers import AutoTokenizer

    from srt.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_chat_non_streaming_answers_with_usage_matching_the_tokenizer(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, QUESTION))
    assert r.usage.completion_tokens <= GREEDY["max_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    content_tokens = tokenizer(choice.message.content, add_special_tokens=False).input_ids
    # the EOS token counts as a completion token but is not part of the text
    assert r.usage.completion_tokens - len(content_tokens) in (0, 1)


def test_chat_stream_concatenates_to_the_non_streamed_text(client):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_stream_and_non_stream_agree(client):
    kw = dict(prompt="The three primary colors are", temperature=0, max_tokens=20)
    full = client.completions.create(model=MODEL, **kw)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model=MODEL, stream=True, **kw) if c.choices
    )
    assert full.object == "text_completion"
    assert streamed == full.choices[0].text and full.choices[0].text


def test_sse_framing_ends_with_done(default_server):
    body = {"prompt": "Hello", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream(
        "POST",
        f"{default_server.openai_base_url}/completions",
        json=body,
        headers=default_server.headers,
        timeout=60,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_gives_length(client):
    r = client.completions.create(
        model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_max_completion_tokens_is_honoured(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_stop_string_gives_stop_and_is_absent(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert " 6" in text, f"the model is expected to continue counting: {text!r}"
    r = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(" 6")]
    assert r.usage.completion_tokens < base.usage.completion_tokens
    streamed = list(
        client.completions.create(
            model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 6"], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_2_returns_two_choices(client):
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=2, max_tokens=8, temperature=0.8, seed=1
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens == 16 or all(c.finish_reason for c in r.choices)
    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, n=2, max_tokens=4, temperature=0, stream=True
        )
    )
    indices = {c.choices[0].index for c in streamed if c.choices}
    assert indices == {0, 1}
    texts = [
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
        for i in (0, 1)
    ]
    assert texts[0] == texts[1]  # greedy samples of one prompt agree


def test_seed_makes_sampling_reproducible(client):
    kw = dict(prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(model=MODEL, **kw).choices[0].text
    b = client.completions.create(model=MODEL, **kw).choices[0].text
    assert a == b


def test_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="Paris is the capital of", max_tokens=4, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(
        abs(max(top.values()) - chosen) < 1e-4
        for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    c = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


def test_sglang_extras_min_tokens_and_ignore_eos(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say yes."}],
        max_tokens=12,
        temperature=0,
        extra_body={"min_tokens": 12, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"


def test_sixteen_concurrent_requests_match_their_sequential_answers(default_server):
    prompts = [f"Write the number {i} in words:" for i in range(16)]
    client = default_server.openai_client(timeout=300)
    alone = {
        p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in prompts[:4]
    }

    async def run():
        aclient = default_server.async_openai_client(timeout=300)
        rs = await asyncio.gather(
            *(aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts)
        )
        await aclient.close()
        return rs

    results = asyncio.run(run())
    assert all(r.choices[0].text for r in results)
    for p, r in zip(prompts, results, strict=True):
        if p in alone:
            assert r.choices[0].text == alone[p]


def test_greedy_output_equals_transformers(default_server, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from srt.model_source import resolve_model_dir

    ids = tokenizer("The history of the Roman Empire").input_ids
    r = httpx.post(
        f"{default_server.base_url}/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
        },
        headers=default_server.headers,
        timeout=120,
    ).json()
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), torch_dtype=torch.float32)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :].tolist()
    assert r["output_ids"] == ref
    assert r["text"] == tokenizer.decode(ref, skip_special_tokens=True)


def test_native_generate(default_server):
    url, h = default_server.base_url, default_server.headers
    r = httpx.post(
        f"{url}/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        headers=h,
        timeout=60,
    )
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == meta["completion_tokens"] <= 4 and isinstance(body["text"], str)
    assert meta["prompt_tokens"] >= 1 and meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    events = []
    with httpx.stream(
        "POST",
        f"{url}/generate",
        json={"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        headers=h,
        timeout=60,
    ) as s:
        events = [line for line in s.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["text"] == body["text"] and last["output_ids"] == body["output_ids"]


def test_info_routes(default_server):
    url, h = default_server.base_url, default_server.headers
    models = httpx.get(f"{url}/v1/models", headers=h).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/health_generate", headers=h, timeout=60).status_code == 200
    info = httpx.get(f"{url}/get_model_info", headers=h).json()
    assert info["served_model_name"] == "SmolLM2-135M-Instruct" and info["is_generation"] is True
    server_info = httpx.get(f"{url}/get_server_info", headers=h).json()
    assert server_info["max_total_num_tokens"] > 0 and "api_key" not in server_info
    assert httpx.post(f"{url}/flush_cache", headers=h, timeout=60).status_code == 200
    assert httpx.post(f"{url}/abort_request", json={"rid": "no-such-request"}, headers=h).json() == {
        "success": False
    }
    metrics = httpx.get(f"{url}/metrics")
    assert metrics.status_code == 200 and "sglang:num_requests_total" in metrics.text


def test_api_key_is_enforced(default_server):
    url = default_server.base_url
    chat = {"messages": QUESTION, "max_tokens": 1}
    generate = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.post(f"{url}/generate", json=generate).status_code == 401
    for verb in ("load", "unload"):  # the adapter routes, SGLang's and vLLM's names
        for route in (f"/{verb}_lora_adapter", f"/v1/{verb}_lora_adapter"):
            r = httpx.post(f"{url}{route}", json={"lora_name": "a", "lora_path": "/tmp"})
            assert r.status_code == 401, route
    # the same routes take the right key
    right = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, headers=right, timeout=60).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers=right).status_code == 200
    assert httpx.post(f"{url}/generate", json=generate, headers=right, timeout=60).status_code == 200
    # probes and scrapers need no key
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    bad = openai.OpenAI(base_url=default_server.openai_base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=default_server.openai_base_url, api_key=API_KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]


def mapped_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_only_the_scheduler_loads_torch_even_after_a_constrained_request(default_server, client):
    """The HTTP process and the detokenizer tokenize and validate without torch (about 240 MB each saved);
    a JSON-schema request, validated in the HTTP process, must not pull it in either."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a number."}],
        max_tokens=8,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "n",
                "schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
            },
        },
    )
    assert out.choices[0].message.content.startswith("{")
    children = default_server.child_pids()
    assert "libtorch_cpu" in mapped_libraries(children["srt-scheduler"])
    assert "libtorch_cpu" not in mapped_libraries(default_server.proc.pid)
    assert "libtorch_cpu" not in mapped_libraries(children["srt-detokenizer"])
    # hiding torch is deliberate: transformers' advice that it was not found would only alarm the reader
    assert "PyTorch was not found" not in default_server.logs()
