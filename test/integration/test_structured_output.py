"""Structured output end to end: JSON-schema output parses and validates over many seeds,
json_object output is JSON, regex and EBNF constraints hold (streaming too), invalid constraints are a 400
naming the field, and the grammar metrics count what was sent."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest

from srt.metrics.text_format import parse_metrics_text, total
from test.integration.conftest import ServerHandle

pytestmark = pytest.mark.slow

# Small enough that 20 samples finish in seconds on a CPU, and bounded so max_tokens always fits it:
# name <= 12 letters, a 3-digit age at most, an enum.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
SCHEMA_MAX_TOKENS = 64
NUM_SEEDS = 20
TIMEOUT = 120.0
# Constrained requests the scheduler received from this module, for the metrics test.
SENT = {"so_requests": 0}


@pytest.fixture(scope="module")
def server(default_server):
    # fp32: the prompts here were chosen for what the fp32 model does with them (e.g. closing its JSON
    # within the token limit); int8 answers close to it, not token for token
    return default_server


def metric_samples(server: ServerHandle) -> list:
    return parse_metrics_text(httpx.get(f"{server.base_url}/metrics", timeout=10).text)


@pytest.fixture(scope="module", autouse=True)
def samples_before(server) -> list:
    """/metrics before this module's first request: the shared server has served other modules."""
    return metric_samples(server)


def post(server: ServerHandle, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=TIMEOUT)


def chat_body(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], **kw}


def test_json_schema_output_validates_over_many_seeds(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    async def one(client, seed: int):
        return await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=fmt,
            temperature=1.0,
            seed=seed,
            max_tokens=SCHEMA_MAX_TOKENS,
        )

    async def run_all():
        async with server.async_openai_client(timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, s) for s in range(NUM_SEEDS)))

    responses = asyncio.run(run_all())
    SENT["so_requests"] += NUM_SEEDS
    outputs = set()
    for r in responses:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        jsonschema.validate(value, SCHEMA)
        outputs.add(choice.message.content)
    assert len(outputs) > 1  # temperature 1 with different seeds: the grammar constrains, not the sampling


def test_json_object_output_is_json(server):
    body = chat_body(
        'Reply with a JSON object with one key "answer" whose value is 4.',
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=SCHEMA_MAX_TOKENS,
    )
    r = post(server, "/v1/chat/completions", body)
    SENT["so_requests"] += 1
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_regex_on_generate(server):
    pattern = "[0-9]{3}-[a-z]{2}"
    r = post(
        server,
        "/generate",
        {"text": "Code:", "sampling_params": {"regex": pattern, "max_new_tokens": 20, "temperature": 1.0}},
    )
    SENT["so_requests"] += 1
    assert r.status_code == 200, r.text
    out = r.json()
    assert re.fullmatch(pattern, out["text"]), out
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_regex_on_generate_streaming(server):
    pattern = "(yes|no), [0-9]{2}"
    body = {"text": "Answer:", "stream": True, "sampling_params": {"regex": pattern, "max_new_tokens": 20}}
    text = ""
    with httpx.stream(
        "POST", f"{server.base_url}/generate", json=body, headers=server.headers, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text = json.loads(line[len("data: ") :])["text"]  # SGLang streams the text so far
    SENT["so_requests"] += 1
    assert re.fullmatch(pattern, text), text


def test_regex_extra_on_completions_streaming(server):
    client = server.openai_client(timeout=TIMEOUT)
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Year:",
        max_tokens=10,
        stream=True,
        extra_body={"regex": "(19|20)[0-9]{2}"},
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    SENT["so_requests"] += 1
    assert re.fullmatch("(19|20)[0-9]{2}", text), text


def test_ebnf_extra_on_chat(server):
    body = chat_body("Is the sky blue?", ebnf='root ::= ("yes" | "no") "."', max_tokens=10, temperature=1.0)
    r = post(server, "/v1/chat/completions", body)
    SENT["so_requests"] += 1
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes.", "no.")


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            chat_body(
                "hi",
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                },
            ),
            "response_format",
        ),
        ("/v1/chat/completions", chat_body("hi", response_format={"type": "json_schema"}), "response_format"),
        ("/v1/completions", {"prompt": "hi", "regex": "[0-9"}, "regex"),
        ("/v1/completions", {"prompt": "hi", "regex": "[0-9]", "ebnf": 'root ::= "a"'}, "ebnf"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"json_schema": "[1, 2]"}},
            "sampling_params.json_schema",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"ebnf": "root ::= undefined"}},
            "sampling_params.ebnf",
        ),
    ],
)
def test_invalid_constraint_is_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or error["param"].startswith(param), error
    assert (
        post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    )


def test_grammar_metrics(server, samples_before):
    assert SENT["so_requests"] >= NUM_SEEDS  # the tests above ran first, on this server
    samples = metric_samples(server)

    def counted(name: str) -> float:  # by this module's requests
        return total(samples, name) - total(samples_before, name)

    assert counted("sglang:grammar_compilation_time_seconds_count") >= 1
    assert counted("sglang:grammar_compilation_time_seconds_sum") > 0
    assert counted("sglang:num_so_requests_total") == SENT["so_requests"]
    assert counted("sglang:num_grammar_cache_hit_total") >= NUM_SEEDS - 1
    assert total(samples, "sglang:num_grammar_queue_reqs") == 0
