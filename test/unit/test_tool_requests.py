"""Specification of tools at the request boundary: `tools`, `tool_choice`, `parallel_tool_calls` and the
history's tool messages are validated strictly (a 400 naming the field), and a forced choice becomes a grammar
that admits only valid calls of the allowed tools, checked with each backend's matcher over real tokens."""

from __future__ import annotations

import json

import pytest

from srt.constrained import GRAMMAR_BACKENDS, GrammarKey, create_grammar_backend
from srt.function_call import create_tool_call_parser
from srt.http_server.openai.chat_tools import ChatTools
from srt.http_server.openai.protocol import ChatCompletionRequest
from srt.http_server.openai.tool_types import MAX_TOOLS
from test.unit.test_request_validation import param_of

MSGS = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


def body(**kw) -> dict:
    return {"messages": MSGS, **kw}


def fn(name: str, **kw) -> dict:
    return {"type": "function", "function": {"name": name, **kw}}


BAD = [
    (body(tools=[fn("has space")]), "tools.0.function.name"),
    (body(tools=[fn("x" * 65)]), "tools.0.function.name"),
    (body(tools=[fn("")]), "tools.0.function.name"),
    (body(tools=[fn("a"), fn("b"), fn("a")]), "tools"),
    (body(tools=[fn("a", parameters=[1])]), "tools.0.function.parameters"),
    (body(tools=[fn("a", parameters="{}")]), "tools.0.function.parameters"),
    (body(tools=[{"type": "retrieval", "function": {"name": "a"}}]), "tools.0.type"),
    (body(tools=[fn(f"t{i}") for i in range(MAX_TOOLS + 1)]), "tools"),
    (body(tools=[]), "tools"),
    (body(tools=[fn("a")], tool_choice={"type": "function", "function": {"name": "b"}}), "tool_choice"),
    (body(tools=[fn("a")], tool_choice="always"), "tool_choice"),
    (body(tool_choice="required"), "tool_choice"),
    (body(tools=[fn("a")], parallel_tool_calls="no"), "parallel_tool_calls"),
    (body(tools=[fn("a")], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (body(tools=[fn("a")], tool_choice="required", regex="a+"), "tool_choice"),
    (
        {"messages": [{"role": "tool", "content": "3"}]},
        "messages.0",
    ),  # a tool result must say which call it answers
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        "messages.0",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "a b", "arguments": "{}"}}
                    ],
                }
            ]
        },
        "messages.0.tool_calls.0.function.name",
    ),
]


@pytest.mark.parametrize("payload, param", BAD)
def test_bad_tool_fields_are_refused_naming_the_field(payload, param):
    assert param_of(ChatCompletionRequest, payload) == param


def test_valid_tool_requests_and_history_are_accepted():
    history = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    req = ChatCompletionRequest.model_validate(
        {"messages": history, "tools": [WEATHER, ADD], "tool_choice": "auto", "parallel_tool_calls": False}
    )
    assert req.constraint() == {} and req.forced_tools is None
    messages, tools = ChatTools(req, create_tool_call_parser("hermes")).prompt(template_takes_tools=False)
    assert tools is None and "get_weather" in messages[0]["content"]
    assert '"arguments": {"city": "Paris", "unit": "c"}' in messages[2]["content"]
    messages, tools = ChatTools(req, create_tool_call_parser("hermes")).prompt(template_takes_tools=True)
    assert [t["function"]["name"] for t in tools] == ["get_weather", "add"]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}
    none = ChatCompletionRequest.model_validate({"messages": MSGS, "tools": [WEATHER], "tool_choice": "none"})
    assert none.constraint() == {} and ChatTools(none, create_tool_call_parser("hermes")).new_stream() is None


def schema_of(**kw) -> str:
    req = ChatCompletionRequest.model_validate(body(tools=[WEATHER, ADD], **kw))
    return req.to_sampling_params(64, None).json_schema


# ---- the grammar admits exactly the valid calls ----


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from srt.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module", params=[b for b in GRAMMAR_BACKENDS if b != "none"])
def backend(request, tokenizer):
    return create_grammar_backend(request.param, tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def admits(backend, tokenizer, schema: str, text: str) -> bool:
    """Whether the grammar lets the model write exactly `text` and then stop."""
    matcher = backend.new_matcher(backend.compile(GrammarKey("json_schema", schema)))
    for t in tokenizer(text, add_special_tokens=False).input_ids:
        if not matcher.accept_token(t):
            return False
    return matcher.is_terminated() or matcher.accept_token(tokenizer.eos_token_id)


WEATHER_CALL = '{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}'
ADD_CALL = '{"name":"add","arguments":{"a":3}}'


@pytest.mark.parametrize(
    "choice, parallel, text, ok",
    [
        ("required", None, f"[{WEATHER_CALL}]", True),
        ("required", None, f"[{WEATHER_CALL},{ADD_CALL}]", True),
        ("required", False, f"[{WEATHER_CALL},{ADD_CALL}]", False),  # exactly one call
        ("required", None, "[]", False),  # at least one
        ("required", None, '[{"name":"delete","arguments":{}}]', False),  # not a tool
        ("required", None, '[{"name":"add","arguments":{"a":"3"}}]', False),  # arguments break the schema
        (
            "required",
            None,
            '[{"name":"get_weather","arguments":{"city":"Paris"}}]',
            False,
        ),  # missing required
        ("required", None, "Sure, here you go", False),
        ({"type": "function", "function": {"name": "add"}}, None, f"[{ADD_CALL}]", True),
        (
            {"type": "function", "function": {"name": "add"}},
            None,
            f"[{WEATHER_CALL}]",
            False,
        ),  # not the named one
    ],
)
def test_forced_choice_grammar_admits_only_valid_calls(backend, tokenizer, choice, parallel, text, ok):
    kw = (
        {"tool_choice": choice}
        if parallel is None
        else {"tool_choice": choice, "parallel_tool_calls": parallel}
    )
    assert admits(backend, tokenizer, schema_of(**kw), text) is ok


def test_forced_choice_output_parses_to_calls_valid_for_the_schema():
    import jsonschema

    req = ChatCompletionRequest.model_validate(body(tools=[WEATHER, ADD], tool_choice="required"))
    message, finish = ChatTools(req, create_tool_call_parser("smollm2")).message(f"[{WEATHER_CALL}]", "stop")
    assert finish == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
