"""`POST /v1/responses` on one real server (the embedded model), through the real `openai` client: string
and item input, a function-call round trip, instructions, `max_output_tokens` cutting an answer, a
`text.format` json_schema the grammar judge enforces, the streaming helper, and docs/api.md's "Parameters of
/v1/responses" table (it lists exactly the request model's fields and the client's parameters; every
refused cell is a 400 naming it, every ignored one leaves the output unchanged). Then one call through the
Shepherd Model Gateway in front of the same server."""

from __future__ import annotations

import inspect
import json
import re

import httpx
import openai
import pytest
from openai.resources.responses import Responses as ResponsesResource

from srt.http_server.openai.responses_protocol import ResponsesRequest
from srt_bench.gateway import ROUND_ROBIN, running_gateway, smg_problem
from test.integration.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

TIMEOUT = 120.0
SHORT = 8  # max_output_tokens of the table's requests: enough to compare outputs, quick on a CPU
CLIENT_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"yes": {"type": "boolean"}},
    "required": ["yes"],
    "additionalProperties": False,
}
# A valid value of every refused and ignored parameter.
SAMPLE = {
    "store": True, "background": True, "previous_response_id": "resp_1", "conversation": "conv_1",
    "context_management": [{"type": "compaction"}], "background_options": {}, "reasoning": {"effort": "low"},
    "include": ["message.output_text.logprobs"], "top_logprobs": 1, "prompt": {"id": "pmpt_1"},
    "max_tool_calls": 1, "image": {}, "moderation": {}, "access_programs": [], "metadata": {"k": "v"},
    "user": "u", "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit"}, "service_tier": "auto", "priority": 1,
}  # fmt: skip


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_string_input_with_instructions(client, model):
    r = client.responses.create(
        model=model,
        input="Is the sky blue?",
        instructions="Answer in one word.",
        temperature=0,
        max_output_tokens=SHORT,
    )
    assert r.object == "response" and r.output[0].type == "message" and r.output_text
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Answer in one word."


def test_max_output_tokens_makes_an_incomplete_response(client, model):
    r = client.responses.create(model=model, input="Write a long story about a dragon.", max_output_tokens=2)
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == (
        "incomplete",
        "max_output_tokens",
        2,
    )


def test_text_format_json_schema_output_parses(client, model):
    r = client.responses.create(
        model=model,
        input="Is the sky blue? Answer as JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}},
        temperature=0,
    )
    assert isinstance(json.loads(r.output_text)["yes"], bool)


def test_function_call_round_trip(client, model):
    """A forced call comes back as a function_call item; the output sent back with its result is the
    next turn's input, and the model answers it."""
    question = {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}
    first = client.responses.create(
        model=model, input=[question], tools=[WEATHER_TOOL], tool_choice="required", temperature=0
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 22 C"}
    second = client.responses.create(
        model=model,
        input=[question, *[item.model_dump(exclude_none=True) for item in first.output], result],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        temperature=0,
        max_output_tokens=SHORT,
    )
    assert second.output[0].type == "message" and second.output_text


def test_stream_helper_collects_the_text_and_the_final_response(client, model):
    kw = {"model": model, "input": "Say hello.", "temperature": 0, "max_output_tokens": SHORT}
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    final_event = events[-1]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and final_event.type == "response.incomplete"
    assert text == final_event.response.output_text == client.responses.create(**kw).output_text
    assert final_event.response.usage.output_tokens == SHORT
    kw["max_output_tokens"] = 64
    with client.responses.stream(**{**kw, "input": "Say hi."}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text


# ---------------------------------------------------------------- the documented table
def documented_table() -> dict[str, str]:
    """{parameter: status} from docs/api.md's "Parameters of /v1/responses" table."""
    lines = (REPO_ROOT / "docs" / "api.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| parameter | responses |"))
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] in {"honoured", "refused", "ignored"}, line
        for name in re.findall(r"`([^`]+)`", cells[0]):
            table[name] = cells[1]
    return table


TABLE = documented_table()


def test_the_table_lists_the_request_model_and_the_clients_parameters():
    assert set(TABLE) == set(ResponsesRequest.model_fields) | set(ResponsesRequest.refused)
    client_params = set(inspect.signature(ResponsesResource.create).parameters) - CLIENT_ONLY
    assert client_params <= set(TABLE), client_params - set(TABLE)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.openai_base_url}/responses", json=body, timeout=TIMEOUT)


def test_each_refused_or_ignored_cell_holds(server):
    """refused: a 400 naming it (null is "not used"); ignored: the same output as without it."""
    plain_body = {"input": "Say hello.", "temperature": 0, "max_output_tokens": SHORT}
    plain = post(server, plain_body).json()["output"][0]["content"][0]["text"]
    for name, status in sorted(TABLE.items()):
        if status == "honoured":
            continue
        r = post(server, {**plain_body, name: SAMPLE[name]})
        if status == "refused":
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
            assert post(server, {**plain_body, name: None}).status_code == 200, name
        else:
            assert r.status_code == 200, (name, r.text)
            assert r.json()["output"][0]["content"][0]["text"] == plain, name


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "seed": 1}, "seed"),
        ({"input": "hi", "store": True}, "store"),
        (
            {"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input"),
        ({"input": "hi", "model": "other"}, "model"),
    ],
    ids=["unknown", "stateful", "tool-choice", "orphan-result", "model"],
)
def test_bad_input_names_its_field_and_the_server_keeps_serving(server, body, param):
    r = post(server, body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert post(server, {"input": "still serving", "max_output_tokens": 1}).status_code == 200


@pytest.mark.skipif(smg_problem() is not None, reason=str(smg_problem()))
def test_behind_the_shepherd_model_gateway(server, client, model):
    """SMG proxies /v1/responses to srt, adding SGLang's neutral extras (accepted) and `store: true` when
    the client sent no `store` (refused, naming it): with `store=False` the answer is srt's own, streamed or
    not."""
    kw = {"model": model, "input": "Say hello.", "temperature": 0, "max_output_tokens": SHORT}
    direct = client.responses.create(**kw)
    with running_gateway([server.base_url], ROUND_ROBIN) as gw:
        via = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        result = via.responses.create(**kw, store=False)
        with via.responses.stream(**kw, store=False) as stream:
            streamed = [e for e in stream if e.type == "response.incomplete"][0].response
        with pytest.raises(openai.BadRequestError) as refused:
            via.responses.create(**kw)
    assert result.output_text == streamed.output_text == direct.output_text
    assert result.status == direct.status == "incomplete"
    assert refused.value.body["param"] == "store"
