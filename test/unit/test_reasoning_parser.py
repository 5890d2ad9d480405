"""Specification of the reasoning readers: the thinking and the answer told apart in any split of the output."""

from __future__ import annotations

import pytest

from srt.reasoning.parser import REASONING_FORMATS

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek-r1"]

# (format, thinking on, output, reasoning, content)
CASES = [
    (QWEN3, True, "<think>\nLet me add.\n2+2=4\n</think>\n\nIt is 4.", "Let me add.\n2+2=4", "It is 4."),
    (QWEN3, True, "It is 4.", "", "It is 4."),  # the model chose not to think
    (QWEN3, True, "  <think>a</think>b", "a", "b"),
    (QWEN3, True, "<think>\nstill thinking when max_tokens cut", "still thinking when max_tokens cut", ""),
    (QWEN3, True, "<thin", "", "<thin"),  # an unfinished tag that never became one is answer
    (QWEN3, True, "x <think>y</think>", "", "x <think>y</think>"),  # a tag inside the answer is text
    (QWEN3, True, "<think></think>answer", "", "answer"),
    (
        QWEN3,
        True,
        "<think>a < b and </thin> is not the tag</think>ok",
        "a < b and </thin> is not the tag",
        "ok",
    ),
    (QWEN3, False, "<think>x</think>y", "", "<think>x</think>y"),  # thinking off: all answer
    (R1, True, "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.", "4"),  # the opening tag was in the prompt
    (R1, True, "<think>\nHmm.</think>4", "Hmm.", "4"),  # or the model wrote it
    (R1, True, "Hmm, cut", "Hmm, cut", ""),
    (R1, True, "", "", ""),
    (QWEN3, True, "<think>日本語の思考</think>答え", "日本語の思考", "答え"),
]


@pytest.mark.parametrize(("fmt", "thinking", "text", "reasoning", "content"), CASES)
def test_a_whole_output_splits_into_reasoning_and_content(fmt, thinking, text, reasoning, content):
    assert fmt.parse(text, thinking) == (reasoning, content)


@pytest.mark.parametrize(("fmt", "thinking", "text", "reasoning", "content"), CASES)
def test_every_cut_into_two_chunks_reads_the_same(fmt, thinking, text, reasoning, content):
    for cut in range(len(text) + 1):
        stream = fmt.new_stream(thinking)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        got = ("".join(r for r, _ in parts), "".join(c for _, c in parts))
        assert got == (reasoning, content), f"cut at {cut}: {text[:cut]!r} | {text[cut:]!r}"


@pytest.mark.parametrize(("fmt", "thinking", "text", "reasoning", "content"), CASES)
def test_one_character_at_a_time_reads_the_same(fmt, thinking, text, reasoning, content):
    stream = fmt.new_stream(thinking)
    parts = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content)


def test_nothing_that_may_be_a_tag_is_sent_early_and_the_answer_waits_for_the_end_tag():
    stream = QWEN3.new_stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>step one") == ("step one", "")
    assert not stream.reasoning_ended
    assert stream.feed(" </thi") == ("", "")  # the space and the tag's start are held
    assert stream.feed("nk>\n\n") == ("", "")
    assert stream.reasoning_ended
    assert stream.feed("Answer") == ("", "Answer")


def test_an_output_that_opens_no_thinking_ends_reasoning_at_its_first_visible_character():
    stream = QWEN3.new_stream()
    stream.feed("  ")
    assert not stream.reasoning_ended
    assert stream.feed("Hi") == ("", "  Hi") and stream.reasoning_ended  # an answer keeps its own whitespace


def test_sglang_parser_names_are_the_registry():
    assert {"qwen3", "deepseek-r1"} <= set(REASONING_FORMATS)
