"""Tools end to end with the real `openai` client: forced choices (`required`, named)
return calls whose arguments validate against the tool's schema, with finish_reason `tool_calls`; streamed
deltas reassemble into the same call; `auto` answers well-formed and streams the same; the next turn, with
the assistant's calls and the tool's result in the history, renders that result and answers well-formed;
bad tool fields are a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# Bounded so a call always fits max_tokens: a short enum-like city, a fixed unit.
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers", "parameters": ADD_PARAMS},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=120)


def create(client, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=kw.pop("messages", MESSAGES),
        tools=TOOLS,
        max_tokens=kw.pop("max_tokens", MAX_TOKENS),
        temperature=0,
        **kw,
    )


def check_calls(choice, allowed: set[str]) -> list[tuple[str, dict]]:
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed(client, **kw) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """content, [(name, arguments text)], finish_reason reassembled from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in create(client, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.id.startswith("call_") and d.function.name, (
                        "the first delta names the call"
                    )
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def test_required_returns_a_valid_call_and_streams_the_same(client):
    response = create(client, tool_choice="required", parallel_tool_calls=False)
    (choice,) = response.choices
    assert len(check_calls(choice, set(SCHEMAS))) == 1
    assert choice.message.content is None
    expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert streamed(client, tool_choice="required", parallel_tool_calls=False) == (
        None,
        expected,
        "tool_calls",
    )


def test_named_choice_calls_that_function(client):
    choice = {"type": "function", "function": {"name": "add"}}
    response = create(client, tool_choice=choice, messages=[{"role": "user", "content": "Add 2 and 3."}])
    calls = check_calls(response.choices[0], {"add"})
    assert all(name == "add" for name, _ in calls)
    content, streamed_calls, finish = streamed(
        client, tool_choice=choice, messages=[{"role": "user", "content": "Add 2 and 3."}]
    )
    assert finish == "tool_calls"
    assert streamed_calls == [
        (c.function.name, c.function.arguments) for c in response.choices[0].message.tool_calls
    ]


def check_answer(choice, allowed: set[str]) -> None:
    """OpenAI's shape for a choice that may or may not call: calls iff finish_reason is `tool_calls`, each
    call's arguments valid for its tool; otherwise text that stopped or ran out of tokens."""
    if choice.message.tool_calls:
        check_calls(choice, allowed)
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)


def test_auto_answers_well_formed_and_streams_the_same(client):
    """The 135M model may or may not call a tool; either way the answer has OpenAI's shape, and the greedy
    stream reassembles into the same answer."""
    (choice,) = create(client, tool_choice="auto").choices
    check_answer(choice, set(SCHEMAS))
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert streamed(client, tool_choice="auto") == (
        choice.message.content or None,
        calls,
        choice.finish_reason,
    )


def test_none_offers_no_tools_and_returns_text(client):
    (choice,) = create(client, tool_choice="none", max_completion_tokens=8).choices
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)


def prompt_tokens(server, messages) -> int:
    """What the chat route would prefill for `messages` with TOOLS, as /tokenize counts it."""
    body = {"model": MODEL, "messages": messages, "tools": TOOLS}
    r = httpx.post(f"{server.base_url}/tokenize", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_second_turn_renders_the_tool_result_and_answers_well_formed(server, client):
    first = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    calls_turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}]
    history = [*calls_turn, {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    second = create(client, messages=history, max_tokens=16)
    assert second.usage.prompt_tokens == prompt_tokens(server, history)
    assert second.usage.prompt_tokens > prompt_tokens(server, calls_turn), "the tool result was not rendered"
    (choice,) = second.choices
    check_answer(choice, set(SCHEMAS))
    assert 0 < second.usage.completion_tokens <= 16
    if choice.finish_reason == "length":
        assert second.usage.completion_tokens == 16


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools.0.function.parameters",
        ),
    ],
)
def test_bad_tool_fields_are_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kw)
    assert err.value.status_code == 400 and err.value.body["param"] == param
