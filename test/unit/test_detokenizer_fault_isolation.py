"""The detokenizer isolates per-request failures: a batch entry whose decoding or stop matching raises finishes
that request with `error` (one log line naming it), every other entry of the batch is converted exactly as
without it, and the failed request's later entries are dropped until the scheduler's final one."""

from __future__ import annotations

import logging

import pytest

from srt.detokenizer.detokenizer_manager import DetokenizerManager
from srt.io_struct import BatchTokenIDOut, FinishReason


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from srt.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def batch(entries: list[tuple[str, list[int], FinishReason | None, object]]) -> BatchTokenIDOut:
    """One scheduler message; each entry is (rid, new token ids, finish reason, stop strings)."""
    return BatchTokenIDOut(
        rids=[e[0] for e in entries],
        output_ids=[e[1] for e in entries],
        finished_reasons=[e[2] for e in entries],
        prompt_tokens=[5] * len(entries),
        completion_tokens=[len(e[1]) for e in entries],
        cached_tokens=[0] * len(entries),
        queued_ts=[1.0] * len(entries),
        scheduled_ts=[2.0] * len(entries),
        first_token_ts=[3.0] * len(entries),
        token_ts=[[4.0] * len(e[1]) for e in entries],
        num_retractions=[0] * len(entries),
        skip_special_tokens=[True] * len(entries),
        stop_strs=[e[3] for e in entries],
    )


def converted(mgr: DetokenizerManager, b: BatchTokenIDOut) -> dict[str, tuple[str, FinishReason | None]]:
    out = mgr.convert(b)
    if out is None:
        return {}
    return dict(zip(out.rids, zip(out.output_strs, out.finished_reasons, strict=True), strict=True))


@pytest.mark.parametrize(
    ("bad_ids", "bad_stops"),
    [
        ("Hello there", 7),  # a stop "list" that is an int
        ("Hello there", [None, 3]),  # stop entries that are not strings
        ([-5, 12], []),  # a token id the tokenizer cannot take
    ],
    ids=["stop-int", "stop-non-str", "negative-token"],
)
def test_a_bad_entry_fails_alone_and_the_rest_of_the_batch_is_converted(
    tokenizer, caplog, bad_ids, bad_stops
):
    a = tokenizer.encode("The quick brown fox")
    c = tokenizer.encode("jumps over; STOP here")
    bad = tokenizer.encode(bad_ids) if isinstance(bad_ids, str) else bad_ids
    clean = [("a", a, None, []), ("c", c, FinishReason("length"), ["STOP"])]
    expected = converted(DetokenizerManager(tokenizer, None, None), batch(clean))

    mgr = DetokenizerManager(tokenizer, None, None)
    with caplog.at_level(logging.ERROR, logger="srt.detokenizer.detokenizer_manager"):
        got = converted(mgr, batch([clean[0], ("bad", bad, None, bad_stops), clean[1]]))

    assert {rid: got[rid] for rid in ("a", "c")} == expected
    text, reason = got["bad"]
    assert text == "" and reason.type == "error" and "detokenizing" in reason.message
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "bad" in errors[0].getMessage()


def test_a_failed_request_sends_nothing_more_and_is_forgotten_at_its_final_entry(tokenizer, caplog):
    mgr = DetokenizerManager(tokenizer, None, None)
    ids = tokenizer.encode("one two three")
    with caplog.at_level(logging.ERROR, logger="srt.detokenizer.detokenizer_manager"):
        first = converted(mgr, batch([("bad", ids[:1], None, 7)]))
        later = converted(mgr, batch([("bad", ids[1:2], None, 7), ("ok", ids, None, [])]))
        final = converted(mgr, batch([("bad", ids[2:], FinishReason("length"), 7)]))
    assert first["bad"][1].type == "error"
    assert "bad" not in later and later["ok"] == ("one two three", None)
    assert final == {}
    assert "bad" not in mgr.detok.states
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def test_a_bad_final_entry_frees_the_state(tokenizer):
    mgr = DetokenizerManager(tokenizer, None, None)
    got = converted(mgr, batch([("bad", tokenizer.encode("bye"), FinishReason("length"), 7)]))
    assert got["bad"][1].type == "error"
    assert mgr.detok.states == {}


def test_memory_error_is_not_isolated(tokenizer, monkeypatch):
    mgr = DetokenizerManager(tokenizer, None, None)

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(mgr.detok, "step", no_memory)
    with pytest.raises(MemoryError):
        mgr.convert(batch([("a", tokenizer.encode("hi"), None, [])]))
