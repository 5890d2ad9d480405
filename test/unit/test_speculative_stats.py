"""Specification of the per-request speculative figures: what a verify step adds, that a step without a draft
and the prefill's token add nothing, and how SGLang's and vLLM's per-request fields derive from the same
counters (srt's accept length counts drafts accepted per spec step, plus the one token every step emits)."""

from __future__ import annotations

import pytest

from srt.speculative.stats import SpecRequestStats, SpecStepStats


def stats_after(steps: list[tuple[int, int]]) -> SpecRequestStats:
    stats = SpecRequestStats()
    for drafts, accepted in steps:
        stats.record(drafts, accepted)
    return stats


def test_a_request_that_never_had_a_draft_has_no_ratios():
    stats = stats_after([(0, 0), (0, 0)])
    assert (stats.verify_steps, stats.draft_tokens, stats.accepted_tokens) == (0, 0, 0)
    assert stats.accept_length is None and stats.accept_rate is None
    assert stats.accepted_histogram == []


def test_spec_steps_accumulate_and_steps_without_a_draft_count_nowhere():
    stats = stats_after([(4, 4), (0, 0), (4, 1), (2, 0)])
    assert stats.verify_steps == 3
    assert stats.draft_tokens == 10
    assert stats.accepted_tokens == 5
    assert stats.accepted_histogram == [1, 1, 0, 0, 1]  # one step each accepted 0, 1 and 4
    assert sum(stats.accepted_histogram) == stats.verify_steps
    assert stats.accept_length == pytest.approx(1 + 5 / 3)  # tokens per spec step: no prefill bias
    assert stats.accept_rate == pytest.approx(0.5)


def test_more_accepted_than_drafted_is_refused():
    with pytest.raises(ValueError):
        SpecRequestStats().record(2, 3)
    with pytest.raises(ValueError):
        SpecStepStats.from_counts([2], [3])


def test_sglang_and_vllm_fields_are_the_same_counters_under_their_names():
    stats = stats_after([(3, 2), (3, 3)])
    assert stats.sglang_meta_info() == {
        "spec_verify_ct": 2,
        "spec_accept_length": 1 + 5 / 2,
        "spec_accept_rate": 5 / 6,
        "spec_num_correct_drafts": 5,
        "spec_num_proposed_drafts": 6,
        "spec_correct_drafts_histogram": [0, 0, 1, 1],
    }
    assert stats.vllm_block() == {
        "num_spec_steps": 2,
        "num_draft_tokens": 6,
        "num_accepted_draft_tokens": 5,
        "mean_acceptance_length": 1 + 5 / 2,
        "draft_acceptance_rate": 5 / 6,
        "acceptance_histogram": [0, 0, 1, 1],
    }


def test_openai_prediction_tokens_count_only_the_drafts_the_prediction_gave():
    """A request with a prediction drafts from its own tokens where the prediction has nothing: those drafts
    are speculation like any other, but neither accepted nor rejected prediction tokens."""
    stats = SpecRequestStats()
    for drafts, accepted, from_prediction in ((3, 2, True), (3, 3, True), (4, 1, False), (0, 0, True)):
        stats.record(drafts, accepted, from_prediction)
    assert (stats.draft_tokens, stats.accepted_tokens) == (10, 6)
    assert (stats.prediction_draft_tokens, stats.prediction_accepted_tokens) == (6, 5)
    assert stats.prediction_usage() == {"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 1}
    total = SpecRequestStats()
    total.add(stats)
    total.add(stats)
    assert total.prediction_usage() == {"accepted_prediction_tokens": 10, "rejected_prediction_tokens": 2}


def test_step_totals_count_requests_with_drafts_and_acceptances_per_position():
    step = SpecStepStats.from_counts([3, 0, 2, 3], [3, 0, 1, 0])
    assert step.num_drafts == 3
    assert step.num_draft_tokens == 8
    assert step.num_accepted_tokens == 4
    assert step.accepted_per_position == (2, 1, 1)


def test_a_responses_choices_add_up_field_by_field():
    a, b = SpecRequestStats(), SpecRequestStats()
    for k, acc in ((4, 4), (4, 1)):
        a.record(k, acc)
    b.record(7, 7)
    total = SpecRequestStats()
    total.add(a)
    total.add(b)
    assert (total.verify_steps, total.draft_tokens, total.accepted_tokens) == (3, 15, 12)
    assert total.accepted_histogram == [0, 1, 0, 0, 1, 0, 0, 1]
    assert sum(total.accepted_histogram) == total.verify_steps


def test_openai_usage_reports_prediction_tokens_only_for_a_request_with_a_prediction():
    """`completion_tokens_details` sums every choice's accepted and rejected prediction tokens (n samples all
    draft from the one prediction); without a prediction it is absent, as OpenAI leaves it."""
    from srt.http_server.openai.serving_common import ChoiceAcc, spec_metrics_block, usage
    from srt.server_args import ServerArgs
    from srt.speculative.defaults import PREDICTION_DRAFTS_PER_STEP

    choices = [ChoiceAcc(completion_tokens=9), ChoiceAcc(completion_tokens=5), ChoiceAcc(completion_tokens=3)]
    for c, (k, acc) in zip(choices[:2], ((7, 5), (6, 6)), strict=True):
        c.spec_stats = SpecRequestStats()
        c.spec_stats.record(k, acc, from_prediction=True)
    assert "completion_tokens_details" not in usage(choices, 3)
    details = usage(choices, 3, predicted=True)["completion_tokens_details"]
    assert details == {"accepted_prediction_tokens": 11, "rejected_prediction_tokens": 2}
    assert spec_metrics_block(ServerArgs(), choices, predicted=True) is None  # vLLM's block is opt-in
    block = spec_metrics_block(ServerArgs(per_request_spec_decode_metrics="summary"), choices, True)
    sd = block["speculative_decoding"]
    assert (sd["num_spec_steps"], sd["num_draft_tokens"], sd["num_accepted_draft_tokens"]) == (2, 13, 11)
    assert sd["mean_acceptance_length"] == pytest.approx(1 + 11 / 2)
    assert sd["num_spec_tokens"] == PREDICTION_DRAFTS_PER_STEP
