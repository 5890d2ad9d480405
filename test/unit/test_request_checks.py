"""The scheduler's own checks on a new request, and the decode-memory reservation ratio it admits with."""

import pytest

from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.request_checks import refusal
from srt.scheduler.schedule_batch import Req
from srt.scheduler.schedule_policy import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    decayed_new_token_ratio,
    new_token_ratio_after_retraction,
)

VOCAB, MAX_INPUT = 100, 8


def check(ids, live=None, **params):
    req = Req("r", ids, SamplingParams(**params))
    return refusal(req, live or {}, MAX_INPUT, VOCAB)


def test_an_ordinary_request_runs():
    assert check([1, 2, 3]) is None


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "the prompt is empty"),
        (list(range(MAX_INPUT + 1)), f"prompt of {MAX_INPUT + 1} tokens exceeds the limit of {MAX_INPUT}"),
        ([VOCAB], f"prompt token ids must be in [0, {VOCAB})"),
        ([-1], f"prompt token ids must be in [0, {VOCAB})"),
    ],
)
def test_a_prompt_that_cannot_run_is_refused_with_its_reason(ids, message):
    reason = check(ids)
    assert reason.type == "error" and reason.message == message


def test_a_rid_already_held_is_refused():
    held = Req("r", [1], SamplingParams())
    reason = check([1, 2], live={"r": held})
    assert reason.type == "error" and "already running" in reason.message


@pytest.mark.parametrize("field", ["max_new_tokens", "min_new_tokens", "top_k", "logprobs"])
@pytest.mark.parametrize("value", [True, 2.0])
def test_integer_fields_of_another_type_are_refused(field, value):
    """verify() lets a bool or a whole float through; whether it then failed would depend on the batch."""
    reason = check([1], **{field: value})
    assert reason.type == "error" and reason.message == f"{field} must be an integer, got {value!r}"


def test_nothing_to_generate_finishes_at_once_with_length():
    assert check([1, 2], max_new_tokens=0).type == "length"
    assert check([1, 2], max_new_tokens=0, logprob_start_len=0) is None  # prompt logprobs: a prefill to run


def test_the_ratio_decays_per_decode_step_down_to_its_floor():
    assert decayed_new_token_ratio(0.5) < 0.5
    assert decayed_new_token_ratio(MIN_NEW_TOKEN_RATIO) == MIN_NEW_TOKEN_RATIO


def test_after_a_retraction_the_ratio_is_what_the_survivors_still_need():
    survivor = Req("s", [1], SamplingParams(max_new_tokens=100))
    survivor.output_ids = [5] * 60
    # (60 decoded + 20 assumed) / 100 allowed
    assert new_token_ratio_after_retraction([survivor]) == pytest.approx(0.8)
    survivor.output_ids = []
    assert new_token_ratio_after_retraction([survivor]) == INIT_NEW_TOKEN_RATIO  # never below the start
    assert new_token_ratio_after_retraction([]) == INIT_NEW_TOKEN_RATIO
