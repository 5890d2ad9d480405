"""The chat side of a reasoning model (docs/reasoning.md): the reasoning reader before the tool-call reader,
the reasoning-token count (by the end tag's id, or by decoded prefixes), and the grammar that waits for the
end-think token. The parser itself is test_reasoning_parser.py's; the server's whole path is
test/integration/test_reasoning_server.py's."""

from __future__ import annotations

import pytest

from srt.constrained import GrammarKey
from srt.constrained.grammar_manager import GrammarManager
from srt.function_call import create_tool_call_parser
from srt.http_server.openai.chat_reasoning import ChoiceReader, ReasoningReading, ReasoningTracker
from srt.reasoning.parser import REASONING, REASONING_CONTENT, REASONING_FORMATS

CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


class CharTokenizer:
    """One token per character, plus `</think>` as one token (id 1000) when `one_token_tag`."""

    END_ID = 1000

    def __init__(self, one_token_tag: bool):
        self.one_token_tag = one_token_tag

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.one_token_tag and text == "</think>":
            return [self.END_ID]
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("</think>" if i == self.END_ID else chr(i) for i in ids)


def reading(one_token_tag: bool, field: str = "both", parser: str = "qwen3") -> ReasoningReading:
    return ReasoningReading.for_server(parser, field, CharTokenizer(one_token_tag))


@pytest.mark.parametrize("one_token_tag", [True, False])
def test_reasoning_tokens_run_through_the_end_tag(one_token_tag):
    r = reading(one_token_tag)
    tok = r.tokenizer
    ids = tok.encode("<think>\nab\n") + tok.encode("</think>") + tok.encode("\n\nok")
    text = tok.decode(ids)
    through_tag = len(tok.encode("<think>\nab\n")) + len(tok.encode("</think>"))
    assert r.end_token_id == (CharTokenizer.END_ID if one_token_tag else None)
    assert r.reasoning_tokens(text, ids, thinking=True) == through_tag
    cut = ids[:9]  # max_tokens inside the thinking: every token is thinking
    assert r.reasoning_tokens(tok.decode(cut), cut, thinking=True) == 9
    answer = tok.encode("just an answer")  # qwen3 may answer without opening a thinking
    assert r.reasoning_tokens(tok.decode(answer), answer, thinking=True) == 0
    assert r.reasoning_tokens(text, ids, thinking=False) == 0  # enable_thinking false: all answer


def test_the_tracker_counts_as_the_reading_and_stamps_the_first_answer_text():
    r = reading(True)
    ids = r.tokenizer.encode("<think>\nab\n") + [CharTokenizer.END_ID] + r.tokenizer.encode("\n\nok")
    tracker = ReasoningTracker(r, thinking=True)
    for k, token in enumerate(ids):
        tracker.feed(r.tokenizer.decode([token]), [token], now=float(k))
    assert tracker.finish(now=99.0) == r.reasoning_tokens(r.tokenizer.decode(ids), ids, True)
    assert tracker.first_answer_ts == float(len(ids) - 2)  # "o": the whitespace before it belongs to neither


@pytest.mark.parametrize("field, names", [("both", {REASONING_CONTENT, REASONING}), (REASONING, {REASONING})])
def test_the_fields_follow_the_flag_and_no_thinking_is_null(field, names):
    r = reading(True, field)
    assert r.fields("t") == dict.fromkeys(names, "t")
    assert r.fields("") == dict.fromkeys(names, None)


def feed_in_pieces(reader: ChoiceReader, text: str, size: int):
    reasoning, content, calls = "", "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        r, delta = reader.feed(piece, final=k == len(pieces) - 1)
        reasoning, content = reasoning + r, content + delta.content
        calls.extend(delta.calls)
    return reasoning, content, calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_tool_calls_are_read_from_the_answer_only(size):
    fmt = REASONING_FORMATS["qwen3"]
    parser = create_tool_call_parser("hermes")
    thought = feed_in_pieces(
        ChoiceReader(fmt.new_stream(), parser.new_stream(["f"])), f"<think>\n{CALL}\n</think>\n\nno", size
    )
    assert thought == (CALL, "no", [])
    reader = ChoiceReader(fmt.new_stream(), parser.new_stream(["f"]))
    reasoning, content, calls = feed_in_pieces(reader, f"<think>\nneed f\n</think>\n\n{CALL}", size)
    assert (reasoning, content) == ("need f", "") and calls[0].name == "f" and reader.num_committed == 1
    cut = feed_in_pieces(
        ChoiceReader(fmt.new_stream(), parser.new_stream(["f"])), f"<think>\n{CALL[:19]}", size
    )
    assert cut == (CALL[:19], "", [])  # max_tokens inside the thinking: no half-read call


class GrammarReq:
    """The two attributes the grammar manager reads from a scheduler request."""

    def __init__(self, think_end_id):
        self.rid, self.grammar, self.think_end_id = "r", None, think_end_id


def test_the_grammar_mask_waits_for_the_end_think_token():
    """A request carrying the end tag's id gets no mask row (and so no advance) until the scheduler's Req
    has appended that token; then its grammar applies from the next token."""
    from transformers import AutoTokenizer

    from srt.model_source import resolve_model_dir
    from srt.sampling.sampling_params import SamplingParams
    from srt.scheduler.schedule_batch import Req

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    manager = GrammarManager(
        "llguidance", lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], synchronous=True
    )
    thinking, plain = GrammarReq(think_end_id=7), GrammarReq(think_end_id=None)
    for req in (thinking, plain):
        manager.submit(req, GrammarKey("regex", "ab"))
    ready, failed = manager.pop_ready()
    assert len(ready) == 2 and not failed
    assert manager.fill_mask([thinking, plain]).rows == [1]
    thinking.think_end_id = None  # what Req.append_token does when the end tag arrives
    assert manager.fill_mask([thinking, plain]).rows == [0, 1]

    req = Req("r", [1, 2], SamplingParams(max_new_tokens=4))
    req.think_end_id = 7
    req.append_token(5, 0.0, None, None)
    assert req.think_end_id == 7
    req.append_token(7, 0.0, None, None)
    assert req.think_end_id is None and req.output_ids == [5, 7]


@pytest.mark.parametrize("size", [1, 2, 5, 100])
@pytest.mark.parametrize("fmt", ["qwen3", "deepseek-r1"])
def test_the_detokenizer_matches_stop_strings_in_the_answer_only(size, fmt):
    from srt.detokenizer.detokenizer_manager import IncrementalDetokenizer

    tok = CharTokenizer(one_token_tag=False)
    opening = "<think>\n" if fmt == "qwen3" else ""  # DeepSeek-R1's template opened it in the prompt
    ids = tok.encode(f"{opening}a stop b\n</think>\n\nok stop x")
    detok, text, reason = IncrementalDetokenizer(tok), "", None
    for k in range(0, len(ids), size):
        out = detok.step("r", ids[k : k + size], None, ["stop"], True, fmt)
        text += out[0]
        if out[2] is not None:
            reason = out[2]
            break
    assert reason.matched == "stop" and text == f"{opening}a stop b\n</think>\n\nok "
    plain = IncrementalDetokenizer(tok).step("p", tok.encode("ok stop x"), None, ["stop"], True, "qwen3")
    assert plain[0] == "ok " and plain[2].matched == "stop"  # no thinking opened: the answer from 0
