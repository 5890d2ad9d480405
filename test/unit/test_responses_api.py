"""`POST /v1/responses` without a model: the request's translation into a chat request, the chat answer's
translation into Responses output items and stream events, and the route served by the real app around a
scripted TokenizerManager, read by the real `openai` client (its `responses.create` and stream helper)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from fastapi.exceptions import RequestValidationError
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from srt.http_server.openai.errors import validation_error
from srt.http_server.openai.responses_protocol import ResponsesRequest
from srt.http_server.openai.serving_responses import OutputBuilder, ResponsesHandler, responses_usage
from srt.http_server.request_parsing import parse_body
from test.unit.test_openai_protocol import SCRIPT, make_client  # noqa: F401 (the scripted app fixture)

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def parse(body: dict) -> ResponsesRequest:
    return parse_body(json.dumps(body).encode(), "application/json", ResponsesRequest)


def refusal(body: dict) -> str:
    """The field a refused body's 400 names, as the HTTP layer reports it."""
    with pytest.raises(RequestValidationError) as e:
        parse(body)
    return validation_error(e.value).param


# ---- request → chat request ----


def test_string_input_and_settings_map_to_chat():
    body = parse(
        {
            "input": "hi",
            "instructions": "be brief",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        }
    ).chat_body()
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (7, 0.5, 0.9)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
    }
    assert "stream" not in body


def test_items_map_to_chat_history():
    """Parts join, a call joins the assistant turn before it, a result becomes a tool message, a
    reasoning item becomes the next assistant turn's thinking."""
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "?"}],
        },
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "developer", "content": "answer in one word"},
    ]
    messages = parse({"input": items}).chat_messages()
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
    assert messages == [
        {"role": "user", "content": "weather ?"},
        {"role": "assistant", "content": "checking", "reasoning_content": "look it up", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "developer", "content": "answer in one word"},
    ]
    parse({"input": items}).to_chat()  # and the chat route accepts it


def test_tools_and_tool_choice_map_to_chat_shape():
    tool = {"type": "function", "name": "weather", "description": "d", "parameters": WEATHER, "strict": True}
    body = parse(
        {"input": "x", "tools": [tool], "tool_choice": {"type": "function", "name": "weather"}}
    ).chat_body()
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "weather", "description": "d", "parameters": WEATHER, "strict": True},
        }
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert parse({"input": "x", "stream": True}).chat_body()["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"seed": 1}, "seed"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.image_url",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "w"}}}, "text.format"),
    ],
)
def test_refused_fields_are_named(body, named):
    assert refusal({"input": "x", **body}) == named


def test_store_false_and_null_refusals_are_accepted():
    parse({"input": "x", "store": False, "background": False, "previous_response_id": None})


# ---- chat answer → output items and events ----


def chat_stream_deltas() -> list[dict]:
    """A reasoning model's streamed answer with text and a call cut across deltas, both thinking names."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}
    return [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "think ", "reasoning": "think "},
        {"reasoning": "more"},
        {"content": "Let me "},
        {"content": "check."},
        {"tool_calls": [call]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]


def test_stream_events_build_the_items_in_order_and_parse():
    builder = OutputBuilder()
    events = [e for d in chat_stream_deltas() for e in builder.feed(d)] + builder.finish(incomplete=False)
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    reasoning, message, call = builder.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think more"}]
    assert message["content"][0]["text"] == "Let me check."
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "weather", '{"city":"Paris"}')
    assert {i["status"] for i in builder.items} == {"completed"}


def test_a_whole_message_makes_the_same_items():
    message = {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "think more",
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": "{}"},
            }
        ],
    }
    builder = OutputBuilder()
    builder.feed(message)
    builder.finish(incomplete=True)
    assert [i["type"] for i in builder.items] == ["reasoning", "message", "function_call"]
    assert builder.items[-1]["status"] == "incomplete"


def test_an_empty_answer_still_has_its_message():
    builder = OutputBuilder()
    builder.finish(incomplete=True)
    assert builder.items[0]["type"] == "message" and builder.items[0]["content"][0]["text"] == ""


def test_usage_counts_reasoning_tokens():
    chat = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    assert responses_usage(chat)["output_tokens_details"] == {"reasoning_tokens": 0}
    chat["completion_tokens_details"] = {"reasoning_tokens": 4}
    assert responses_usage(chat) == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 4},
        "total_tokens": 14,
    }


# ---- the route, read by the real openai client ----


@pytest.fixture(scope="module")
def oai(make_client):  # noqa: F811 (the imported fixture)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=make_client())


def test_create_answers_a_response(oai):
    r = oai.responses.create(model="SmolLM2-135M-Instruct", input="hi", instructions="be brief")
    assert isinstance(r, Response)
    assert (r.status, r.output_text) == ("completed", "".join(SCRIPT))
    assert r.usage.output_tokens > 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_helper_collects_text_and_final_response(oai):
    with oai.responses.stream(model="SmolLM2-135M-Instruct", input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == "".join(SCRIPT)
    assert [events[0].type, events[1].type, events[-1].type] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]
    assert final.usage.output_tokens > 0


def test_refusal_is_an_openai_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="SmolLM2-135M-Instruct", input="hi", store=True)
    assert e.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="SmolLM2-135M-Instruct", input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"


def chat_sse(*payloads: dict) -> list[str]:
    return [f"data: {json.dumps(p)}\n\n" for p in payloads] + ["data: [DONE]\n\n"]


async def translate(chunks: list[str], **body) -> list[dict]:
    async def source():
        for c in chunks:
            yield c

    handler = ResponsesHandler(chat=None)
    req = parse({"input": "x", "stream": True, **body})
    out = [e async for e in handler._stream(req, source(), "resp_1", 0, "m")]
    return [json.loads(e.split("data: ", 1)[1]) for e in out]


def test_a_chat_stream_becomes_the_responses_events():
    """Usage (reasoning tokens included) reaches `response.incomplete` when the chat stream ended with
    `length`; each SSE frame's `event:` is its data's type."""
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    usage["completion_tokens_details"] = {"reasoning_tokens": 2}
    chunks = chat_sse(
        {"choices": [{"index": 0, "delta": {"reasoning": "hm"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": usage},
    )
    events = asyncio.run(translate(chunks, max_output_tokens=4))
    for e in events:
        EVENT.validate_python(e)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    response = Response.model_validate(final["response"])
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "ok" and response.output[0].content[0].text == "hm"
    assert response.usage.output_tokens_details.reasoning_tokens == 2


def test_an_error_mid_stream_is_an_error_event():
    error = {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    chunks = chat_sse({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}, error)
    events = asyncio.run(translate(chunks))
    assert events[-1]["type"] == "error" and events[-1]["message"] == "boom"
    EVENT.validate_python(events[-1])
