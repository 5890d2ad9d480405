"""Incremental detokenization with the real SmolLM2 tokenizer: never a broken character, stop strings cut."""

from __future__ import annotations

import pytest

from srt.detokenizer.detokenizer_manager import REPLACEMENT_CHAR, DetokenizerManager, IncrementalDetokenizer
from srt.io_struct import BatchStrOut, BatchTokenIDOut, FinishReason

MIXED_TEXT = "Grüße aus Köln 🎉🚀 日本語のテキスト — naïve café ✓ done."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from srt.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def stream(detok: IncrementalDetokenizer, ids: list[int], stops=(), skip=True, per_msg=1, rid="r"):
    """Feed `ids` in messages of `per_msg` tokens, the last one finished by length; return the steps."""
    steps = []
    for start in range(0, len(ids), per_msg):
        chunk = ids[start : start + per_msg]
        last = start + per_msg >= len(ids)
        steps.append(detok.step(rid, chunk, FinishReason("length") if last else None, list(stops), skip))
    return steps


def test_emoji_and_cjk_stream_never_emit_a_broken_character(tokenizer):
    ids = tokenizer.encode(MIXED_TEXT)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids), "test text must split characters"
    steps = stream(IncrementalDetokenizer(tokenizer), ids)
    deltas = [s[0] for s in steps]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert steps[-1][2] == FinishReason("length")


def test_multi_token_messages_give_the_same_text(tokenizer):
    ids = tokenizer.encode(MIXED_TEXT)
    steps = stream(IncrementalDetokenizer(tokenizer), ids, per_msg=3)
    assert "".join(s[0] for s in steps) == tokenizer.decode(ids)
    assert sum(s[1] for s in steps) == len(ids)


def test_state_is_forgotten_after_the_final_entry(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    stream(detok, tokenizer.encode("hello world"))
    assert detok.states == {}


def test_stop_string_is_cut_with_everything_after_it(tokenizer):
    text = "The answer is 42. STOP and then more text that must not appear."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    steps = []
    for t in ids:
        steps.append(detok.step("r", [t], None, ["STOP"], True))
        if steps[-1] is not None and steps[-1][2] is not None:
            break
    i = len(steps) - 1
    out = "".join(s[0] for s in steps)
    assert out == "The answer is 42. "
    assert steps[-1][2] == FinishReason("stop", matched="STOP")
    # the request stopped at the token that completed the stop string, not at the end of the text
    assert i + 1 < len(ids)
    assert "STOP" in tokenizer.decode(ids[: i + 1]) and "STOP" not in tokenizer.decode(ids[:i])


def test_outputs_after_a_stop_are_dropped_until_the_scheduler_finishes(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("abc END xyz")
    results = [detok.step("r", [t], None, ["END"], True) for t in ids]
    finished = [r for r in results if r is not None and r[2] is not None]
    assert len(finished) == 1
    assert all(r is None for r in results[results.index(finished[0]) + 1 :])
    assert "r" in detok.states  # still waiting for the scheduler's final (abort) entry
    assert detok.step("r", [], FinishReason("abort"), ["END"], True) is None
    assert detok.states == {}


def test_a_possible_stop_prefix_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("one two thr")
    emitted = "".join(detok.step("r", [t], None, ["three"], True)[0] for t in ids)
    assert emitted == "one two "  # "thr" might become "three"
    rest = detok.step("r", tokenizer.encode("ee"), None, ["three"], True)
    assert rest[2] == FinishReason("stop", matched="three") and rest[0] == ""
    detok2 = IncrementalDetokenizer(tokenizer)
    for t in ids:
        detok2.step("r", [t], None, ["three"], True)
    released = detok2.step("r", tokenizer.encode("ow"), FinishReason("length"), ["three"], True)
    assert released[0] == "throw"


def test_stop_string_spanning_several_tokens_with_emoji(tokenizer):
    text = "Party 🎉🎉 time"
    ids = tokenizer.encode(text)
    steps = stream(IncrementalDetokenizer(tokenizer), ids, stops=["🎉🎉"])
    done = [s for s in steps if s is not None]
    assert "".join(s[0] for s in done) == "Party "
    assert done[-1][2] == FinishReason("stop", matched="🎉🎉")


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hi there") + [eos]
    skipped = stream(IncrementalDetokenizer(tokenizer), ids, skip=True)
    kept = stream(IncrementalDetokenizer(tokenizer), ids, skip=False)
    assert "".join(s[0] for s in skipped) == "Hi there"
    assert "".join(s[0] for s in kept) == "Hi there<|im_end|>"


def _batch(rids, output_ids, finished, stops, completion_tokens):
    n = len(rids)
    return BatchTokenIDOut(
        rids=rids,
        output_ids=output_ids,
        finished_reasons=finished,
        prompt_tokens=[5] * n,
        completion_tokens=completion_tokens,
        cached_tokens=[0] * n,
        queued_ts=[1.0] * n,
        scheduled_ts=[2.0] * n,
        first_token_ts=[3.0] * n,
        token_ts=[[4.0 + k for k in range(len(o))] for o in output_ids],
        num_retractions=[0] * n,
        skip_special_tokens=[True] * n,
        stop_strs=stops,
    )


def test_manager_convert_cuts_meta_at_the_stop_token(tokenizer):
    mgr = DetokenizerManager(tokenizer, None, None)
    a = tokenizer.encode("x = 1; END; y = 2")
    b = tokenizer.encode("plain text")
    out = mgr.convert(
        _batch(["a", "b"], [a, b], [None, FinishReason("length")], [["END"], []], [len(a), len(b)])
    )
    assert isinstance(out, BatchStrOut)
    assert out.rids == ["a", "b"]
    assert out.output_strs == ["x = 1; ", "plain text"]
    assert out.finished_reasons[0] == FinishReason("stop", matched="END")
    used = len(out.output_ids[0])
    assert 0 < used < len(a) and out.completion_tokens[0] == used and len(out.token_ts[0]) == used
    assert out.completion_tokens[1] == len(b) and out.prompt_tokens == [5, 5]
    assert out.output_token_logprobs is None
    # the stopped request's later outputs are dropped: nothing left to send
    assert mgr.convert(_batch(["a"], [[11]], [None], [["END"]], [len(a) + 1])) is None


def test_manager_convert_cuts_the_speculative_figures_with_the_output(tokenizer):
    """A stop string that ends the output inside a verify step's run cuts its figures there (the drafts after
    the cut are neither drafts nor accepted: srt/speculative/stats.py); figures travel with final entries
    only, though the scheduler hands them over with each message a stop string may end."""
    from srt.speculative.stats import SpecRequestStats, SpecStep

    mgr = DetokenizerManager(tokenizer, None, None)
    a = tokenizer.encode("x = 1; END; y = 2")
    b = tokenizer.encode("plain text")
    figures = []
    for _ in range(2):
        stats = SpecRequestStats()  # one step: every token after the first came from accepted drafts
        stats.record(SpecStep(1, len(a) - 1, len(a) - 2, from_prediction=True), may_be_cut=True)
        figures.append(stats)
    batch = _batch(["a", "b"], [a, b], [None, None], [["END"], ["END"]], [len(a), len(b)])
    batch.spec_stats = figures
    out = mgr.convert(batch)
    used = out.completion_tokens[0]
    assert used < len(a) and out.spec_stats[1] is None
    cut = out.spec_stats[0]
    assert (cut.verify_steps, cut.draft_tokens, cut.accepted_tokens) == (1, used - 1, used - 1)
    assert cut.prediction_usage() == {"accepted_prediction_tokens": used - 1, "rejected_prediction_tokens": 0}
