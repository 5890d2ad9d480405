"""A stop string stops the work (docs/architecture.md, "The life of a request", steps 9-11): the scheduler, the
detokenizer and the HTTP process's rule run as one ring, one scheduler step at a time, on the tiny random
Llama with SmolLM2's tokenizer. A request whose stop string matches ends in the scheduler within two steps of
the step whose tokens completed it, streamed or not (it used to decode on to max_tokens when not streamed),
and its speculative figures, cut where the stop string cut the output, count only the completion's
positions (srt/speculative/stats.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest

from srt.detokenizer.detokenizer_manager import DetokenizerManager
from srt.io_struct import AbortReq, TokenizedGenerateReqInput
from srt.scheduler.scheduler import Scheduler
from srt.speculative.stats import SpecRequestStats
from srt.tokenizer_loading import load_tokenizer
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import make_scheduler, prompts

MAX_NEW = 60
STEPS_TO_STOP = 2  # the most scheduler steps from the one whose tokens matched to the one that ends it
MAX_STEPS = 500


@dataclass
class Ended:
    """What the ring saw of one request."""

    completion_tokens: int = 0  # what the answer holds (the detokenizer's final entry)
    text: str = ""
    matched_step: int | None = None  # the step whose message the detokenizer ended on the stop string
    figures: SpecRequestStats | None = None  # with that final entry
    handed_figures: SpecRequestStats | None = None  # the scheduler's, as handed to the detokenizer then
    left_step: int | None = None  # the step whose message carried the scheduler's own final entry
    generated: int = 0  # tokens the scheduler generated for it in all


def run_ring(sched: Scheduler, detok: DetokenizerManager, recv: TokenizedGenerateReqInput) -> Ended:
    """Step the scheduler; pass each step's message through the detokenizer; for a final entry a stop string
    ended, send the scheduler a silent abort (the HTTP process's rule, `TokenizerManager._finish`), which it
    takes before its next step, as its loop drains its socket before each step."""
    ended = Ended()
    sched.add_request(recv)
    aborts: list[AbortReq] = []
    for step in range(MAX_STEPS):
        for abort in aborts:
            sched.abort_request(abort)
        aborts = []
        out = sched.step()
        if out is None:
            continue
        i = out.rids.index(recv.rid) if recv.rid in out.rids else None
        if i is None:
            continue
        ended.generated = out.completion_tokens[i]
        scheduler_final = out.finished_reasons[i] is not None
        handed = copy.deepcopy(out.spec_stats[i]) if out.spec_stats is not None else None
        text = detok.convert(out)  # None once the detokenizer has ended the request: its entries are dropped
        if text is not None:
            ended.text += text.output_strs[0]
            reason = text.finished_reasons[0]
            if reason is not None and ended.matched_step is None:
                assert reason.type == "stop" and isinstance(reason.matched, str), reason
                ended.matched_step, ended.completion_tokens = step, text.completion_tokens[0]
                ended.figures = text.spec_stats[0] if text.spec_stats is not None else None
                ended.handed_figures = handed
                aborts.append(AbortReq(recv.rid, silent=True))
        if scheduler_final:
            ended.left_step = step
            return ended
    raise AssertionError("the scheduler never ended the request")


def stop_string_for(tokenizer, output_ids: list[int], at_least: int) -> tuple[str, int]:
    """A piece of the answer's text, first found where token k >= `at_least` adds it: (the piece, k + 1 = the
    tokens an answer cut there holds)."""
    full = tokenizer.decode(output_ids)
    for k in range(at_least, len(output_ids)):
        before = tokenizer.decode(output_ids[:k])
        piece = tokenizer.decode(output_ids[: k + 1])[len(before) :]
        if len(piece.strip()) >= 2 and full.find(piece) == len(before):
            return piece, k + 1
    raise AssertionError("no piece of the answer occurs first late enough")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def sched(tiny_model_dir) -> Scheduler:
    return make_scheduler(tiny_model_dir)


@pytest.fixture(scope="module")
def answer(sched) -> tuple[list[int], list[int]]:
    """A prompt and its greedy answer without a stop."""
    prompt = prompts(1, seed=0)[0]
    return prompt, drive(sched, {0: [request("ref", prompt, greedy(MAX_NEW))]})["ref"].output_ids


@pytest.mark.parametrize("predicted", [False, True], ids=["plain", "prediction"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_ends_the_request_within_two_steps(sched, tokenizer, answer, stream, predicted):
    """With an exact prediction (every verify step accepts up to 7 drafts and the stop falls inside a run),
    the final figures count only the drafts before the cut: every one accepted, the prefill's token and each
    full step's bonus token not drafts, so accepted + rejected prediction tokens < completion tokens."""
    prompt, answer = answer
    stop, cut = stop_string_for(tokenizer, answer, at_least=12)
    recv = request(f"r-{stream}-{predicted}", prompt, greedy(MAX_NEW, stop=[stop]), stream=stream)
    if predicted:
        recv.prediction_ids = list(answer)
    ended = run_ring(sched, DetokenizerManager(tokenizer, None, None), recv)

    full = tokenizer.decode(answer)
    assert ended.completion_tokens == cut and ended.text == full[: full.find(stop)]
    assert ended.left_step - ended.matched_step <= STEPS_TO_STOP
    # the work stopped with the step that matched: no step after it generated a token
    steps_generated = ended.generated - cut
    assert steps_generated < (8 if predicted else 1), (ended.generated, cut)
    if not predicted:
        assert ended.figures is None
        return
    f = ended.figures
    usage = f.prediction_usage()
    assert f.accepted_tokens == f.draft_tokens == usage["accepted_prediction_tokens"] > 0
    assert usage["rejected_prediction_tokens"] == 0
    assert f.accepted_tokens <= cut - f.verify_steps  # each step but the cut one also output its bonus token
    assert sum(usage.values()) < ended.completion_tokens
    assert ended.handed_figures.accepted_tokens > f.accepted_tokens, "the stop must cut a run"
