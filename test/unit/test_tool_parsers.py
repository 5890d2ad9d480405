"""Specification of the tool-call parsers (srt/function_call): each format reads calls out of a whole
completion and out of a stream split anywhere, the two agree, malformed calls stay content, and the prompt
side writes tools and history in the format."""

from __future__ import annotations

import json
import random

import pytest

from srt.function_call import TOOL_CALL_PARSERS, ToolCallStream, create_tool_call_parser
from srt.function_call.tool_schema import forced_call_stream

NAMES = ["get_weather", "add"]
SPLIT_SEEDS = range(40)
MAX_PIECE_CHARS = 6

HERMES_TWO = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <b>", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}"}]}}\n</tool_call>\n'
)
SMOLLM2_LIST = (
    '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Ly\\u00f6n"}},\n'
    '{"name": "add", "arguments": {"a": 1}}\n]</tool_call>'
)
# (parser, text, expected content, expected [(name, arguments object)])
CASES = [
    (
        "hermes",
        HERMES_TWO,
        "Let me check.",
        [("get_weather", {"city": "Paris <b>", "unit": "c"}), ("add", {"a": 1, "b": [2, {"c": "}"}]})],
    ),
    ("smollm2", SMOLLM2_LIST, None, [("get_weather", {"city": "Lyön"}), ("add", {"a": 1})]),
    (
        "smollm2",
        HERMES_TWO,
        "Let me check.",
        [("get_weather", {"city": "Paris <b>", "unit": "c"}), ("add", {"a": 1, "b": [2, {"c": "}"}]})],
    ),
    # keys in the other order: read once the object is complete
    (
        "hermes",
        '<tool_call>{"arguments": {"x": true}, "name": "add"}</tool_call>',
        None,
        [("add", {"x": True})],
    ),
    # "parameters" for "arguments" (Llama's word)
    ("hermes", '<tool_call>{"name": "add", "parameters": {}}</tool_call> done', "done", [("add", {})]),
    # plain text, a lone "<", a tag prefix at the very end
    ("hermes", "a < b and <tool_c", "a < b and <tool_c", []),
    ("smollm2", "  just text\n", "just text", []),
    # malformed blocks stay content
    ("hermes", "x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    (
        "hermes",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "add", "arguments": "1"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "1"}</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>[{"name": "add", "arguments": {}}]</tool_call>',
        '<tool_call>[{"name": "add", "arguments": {}}]</tool_call>',
        [],
    ),
    (
        "smollm2",
        '<tool_call>[{"name": "nope", "arguments": {}}]</tool_call>',
        '<tool_call>[{"name": "nope", "arguments": {}}]</tool_call>',
        [],
    ),
    # in a list, an entry naming an unknown tool is dropped
    (
        "smollm2",
        '<tool_call>[{"name": "nope", "arguments": {}}, {"name": "add", "arguments": {"a": 2}}]</tool_call>',
        None,
        [("add", {"a": 2})],
    ),
]


def stream_all(
    stream: ToolCallStream, text: str, rng: random.Random
) -> tuple[str | None, list[tuple[str, str]]]:
    """Feed `text` in random pieces; reassemble the deltas as a client does (by index, first delta named)."""
    content, calls = "", {}
    pieces, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, MAX_PIECE_CHARS)
        pieces.append(text[i:j])
        i = j
    reads = [stream.feed(p) for p in pieces] + [stream.finish()]
    for read in reads:
        content += read.content
        for d in read.calls:
            if d.index not in calls:
                assert d.id is not None and d.id.startswith("call_") and d.name, (
                    "the first delta names the call"
                )
                calls[d.index] = [d.name, ""]
            else:
                assert d.id is None
            calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_completion_is_read(name, text, content, calls):
    result = create_tool_call_parser(name).parse(text, NAMES)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) > len("call_") for c in result.calls)
    assert len({c.id for c in result.calls}) == len(result.calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_stream_split_anywhere_equals_the_whole_reading(name, text, content, calls):
    parser = create_tool_call_parser(name)
    whole = parser.parse(text, NAMES)
    expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    for seed in SPLIT_SEEDS:
        assert stream_all(parser.new_stream(NAMES), text, random.Random(seed)) == expected, seed


def test_arguments_stream_before_the_call_ends():
    stream = create_tool_call_parser("hermes").new_stream(NAMES)
    first = stream.feed('<tool_call>\n{"name": "add", "arguments": {"a": ')
    assert [(d.name, d.arguments) for d in first.calls] == [("add", ""), (None, '{"a": ')]
    assert [d.arguments for d in stream.feed("12").calls] == ["12"]
    assert [d.arguments for d in stream.feed("}}\n</tool_call>").calls] == ["}"]


def test_text_that_may_start_a_tag_is_held_back():
    stream = create_tool_call_parser("hermes").new_stream(NAMES)
    assert stream.feed("Hi <tool").content == "Hi"
    assert stream.feed("box>").content == " <toolbox>"


def test_an_unfinished_call_is_content_in_a_whole_reading_but_streamed_as_far_as_it_went():
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": [1, '
    parser = create_tool_call_parser("hermes")
    whole = parser.parse(text, NAMES)
    assert whole.calls == [] and whole.content == text.strip()
    content, calls = stream_all(parser.new_stream(NAMES), text, random.Random(0))
    assert content == "ok" and calls == [("add", '{"a": [1, ')]


def test_forced_choice_output_is_a_tagless_list():
    text = '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"add","arguments":{"a":1}}]'
    result = forced_call_stream(NAMES).parse_all(text)
    assert result.content is None
    assert [(c.name, c.arguments) for c in result.calls] == [
        ("get_weather", '{"city":"Oslo"}'),
        ("add", '{"a":1}'),
    ]
    for seed in SPLIT_SEEDS:
        assert stream_all(forced_call_stream(NAMES), text, random.Random(seed)) == (
            None,
            [(c.name, c.arguments) for c in result.calls],
        )


def test_registry_names_sglang_parsers_and_refuses_unknown():
    assert {"hermes", "qwen25", "smollm2"} <= set(TOOL_CALL_PARSERS)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        create_tool_call_parser("nope")


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "user", "content": "add 1 and 2"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
        ],
    },
    {"role": "tool", "content": "3", "tool_call_id": "call_1"},
]


@pytest.mark.parametrize("name", ["hermes", "smollm2"])
def test_history_and_tools_render_in_the_format_and_read_back(name):
    parser = create_tool_call_parser(name)
    messages = parser.render_messages(HISTORY, TOOLS)
    assert messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    assert [m["role"] for m in messages[1:]] == ["user", "assistant", "user"]
    assert messages[3]["content"] == "<tool_response>\n3\n</tool_response>"
    # the assistant's rendered call is what the parser reads back
    back = parser.parse(messages[2]["content"], ["add"])
    assert [(c.name, json.loads(c.arguments)) for c in back.calls] == [("add", {"a": 1, "b": 2})]


def test_preamble_joins_an_existing_system_message_and_no_tools_means_no_preamble():
    parser = create_tool_call_parser("hermes")
    messages = parser.render_messages([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], TOOLS)
    assert len(messages) == 2 and messages[0]["content"].startswith("Be brief.\n\n")
    assert parser.render_messages(HISTORY[:1], None) == HISTORY[:1]
