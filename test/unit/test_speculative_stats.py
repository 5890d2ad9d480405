"""Specification of the per-request speculative figures: what a verify step adds, that a step without a draft
and the prefill's token add nothing, and how SGLang's and vLLM's per-request fields derive from the same
counters (srt's accept length counts drafts accepted per spec step, plus the one token every step emits)."""

from __future__ import annotations

import pytest

from srt.speculative.stats import SpecRequestStats, SpecStep, SpecStepStats


def stats_after(steps: list[tuple[int, int]], from_prediction: bool = False) -> SpecRequestStats:
    """The figures after spec steps given as (drafts, accepted), one after another from output position 1
    (the prefill's token is position 0)."""
    stats, position = SpecRequestStats(), 1
    for drafts, accepted in steps:
        stats.record(SpecStep(position, drafts, accepted, from_prediction))
        position += accepted + 1
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
        SpecStep(1, 2, 3)


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
        stats.record(SpecStep(1, drafts, accepted, from_prediction))
    assert (stats.draft_tokens, stats.accepted_tokens) == (10, 6)
    assert (stats.prediction_draft_tokens, stats.prediction_accepted_tokens) == (6, 5)
    assert stats.prediction_usage() == {"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 1}
    total = SpecRequestStats()
    total.add(stats)
    total.add(stats)
    assert total.prediction_usage() == {"accepted_prediction_tokens": 10, "rejected_prediction_tokens": 2}


def test_step_totals_count_requests_with_drafts_and_acceptances_per_position():
    step = SpecStepStats.from_steps(
        [SpecStep(1, k, a) for k, a in ((3, 3), (0, 0), (2, 1), (3, 0))] + [None]  # None: nothing output
    )
    assert step.num_drafts == 3
    assert step.num_draft_tokens == 8
    assert step.num_accepted_tokens == 4
    assert step.accepted_per_position == (2, 1, 1)


def test_a_responses_choices_add_up_field_by_field():
    a, b = stats_after([(4, 4), (4, 1)]), stats_after([(7, 7)])
    total = SpecRequestStats()
    total.add(a)
    total.add(b)
    assert (total.verify_steps, total.draft_tokens, total.accepted_tokens) == (3, 15, 12)
    assert total.accepted_histogram == [0, 1, 0, 0, 1, 0, 0, 1]
    assert sum(total.accepted_histogram) == total.verify_steps


def test_openai_usage_reports_prediction_tokens_only_for_a_request_with_a_prediction():
    """`completion_tokens_details` sums every choice's accepted and rejected prediction tokens (n samples all
    draft from the one prediction); without a prediction it is absent, as OpenAI leaves it."""
    from srt.http_server.openai.response_frame import spec_metrics_block, usage
    from srt.http_server.openai.serving_common import ChoiceAcc
    from srt.server_args import ServerArgs
    from srt.speculative.defaults import PREDICTION_DRAFTS_PER_STEP

    choices = [ChoiceAcc(completion_tokens=9), ChoiceAcc(completion_tokens=5), ChoiceAcc(completion_tokens=3)]
    for c, (k, acc) in zip(choices[:2], ((7, 5), (6, 6)), strict=True):
        c.spec_stats = stats_after([(k, acc)], from_prediction=True)
    assert "completion_tokens_details" not in usage(choices, 3)
    details = usage(choices, 3, predicted=True)["completion_tokens_details"]
    # one rejected position: the first choice's step output the model's token where draft 5 was
    assert details == {"accepted_prediction_tokens": 11, "rejected_prediction_tokens": 1}
    assert spec_metrics_block(ServerArgs(), choices, predicted=True) is None  # vLLM's block is opt-in
    block = spec_metrics_block(ServerArgs(per_request_spec_decode_metrics="summary"), choices, True)
    sd = block["speculative_decoding"]
    assert (sd["num_spec_steps"], sd["num_draft_tokens"], sd["num_accepted_draft_tokens"]) == (2, 13, 11)
    assert sd["mean_acceptance_length"] == pytest.approx(1 + 11 / 2)
    assert sd["num_spec_tokens"] == PREDICTION_DRAFTS_PER_STEP


def open_stats(steps: list[tuple[int, int]], from_prediction: bool = True) -> SpecRequestStats:
    """`stats_after`, every step kept open for a cut (a request with stop strings)."""
    stats, position = SpecRequestStats(), 1
    for drafts, accepted in steps:
        stats.record(SpecStep(position, drafts, accepted, from_prediction), may_be_cut=True)
        position += accepted + 1
    return stats


def test_a_cut_counts_only_the_positions_the_completion_holds():
    """Steps output positions 1-5 (4 accepted + bonus), 6-7 (1 of 4 + recovered) and 8-11 (3 of 3 +
    bonus). A stop ending the output after position 9 keeps the third step's first two drafts: it counts as
    a step of 2 drafts, both accepted; one after position 6 keeps one draft of the second and drops the
    third; a cut after the last position changes nothing."""
    whole = open_stats([(4, 4), (4, 1), (3, 3)])
    assert (whole.verify_steps, whole.draft_tokens, whole.accepted_tokens) == (3, 11, 8)
    same = open_stats([(4, 4), (4, 1), (3, 3)])
    same.truncate(12)
    assert same == whole
    cut = open_stats([(4, 4), (4, 1), (3, 3)])
    cut.truncate(10)
    assert (cut.verify_steps, cut.draft_tokens, cut.accepted_tokens) == (3, 10, 7)
    assert cut.accepted_histogram == [0, 1, 1, 0, 1]
    assert cut.prediction_usage() == {"accepted_prediction_tokens": 7, "rejected_prediction_tokens": 1}
    cut.truncate(7)
    assert (cut.verify_steps, cut.draft_tokens, cut.accepted_tokens) == (2, 5, 5)
    assert cut.accepted_histogram == [0, 1, 0, 0, 1]  # no step of 4 accepted and a rejection is left
    assert cut.prediction_usage() == {"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 0}
    cut.truncate(1)  # only the prefill's token: no step counts
    assert (cut.verify_steps, cut.draft_tokens, cut.accepted_tokens, cut.accepted_histogram) == (0, 0, 0, [])


def test_handing_off_closes_the_steps_a_later_cut_cannot_reach():
    """The copy that goes out with an output message holds the steps since the previous one; the request's
    own record keeps the totals and no longer cuts them."""
    stats = open_stats([(4, 4)])
    sent = stats.hand_off()
    assert sent.open_steps and not stats.open_steps
    stats.record(SpecStep(6, 3, 1, True), may_be_cut=True)
    later = stats.hand_off()
    later.truncate(7)  # cuts the new step only
    assert (later.verify_steps, later.draft_tokens, later.accepted_tokens) == (2, 5, 5)
    assert (stats.verify_steps, stats.draft_tokens, stats.accepted_tokens) == (2, 7, 5)


@pytest.mark.parametrize("seed", range(20))
def test_accepted_and_rejected_never_exceed_the_completion_whatever_the_cut(seed):
    """Random steps from predictions and own tokens, a random cut: accepted + rejected prediction tokens and
    accepted drafts are at most the completion tokens after the prefill's one, per-position counts sum to the
    accepted drafts, and a cut never adds."""
    import random

    rng = random.Random(seed)
    stats, position = SpecRequestStats(), 1
    while position < 60:
        k = rng.randint(0, 7)
        a = rng.randint(0, k)
        stats.record(SpecStep(position, k, a, rng.random() < 0.7), may_be_cut=True)
        position += a + 1
    before = SpecRequestStats()
    before.add(stats)
    completion = rng.randint(1, position)
    stats.truncate(completion)
    usage = stats.prediction_usage()
    assert usage["accepted_prediction_tokens"] + usage["rejected_prediction_tokens"] <= completion - 1
    assert stats.accepted_tokens <= completion - 1
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert sum(stats.accepted_histogram) == stats.verify_steps
    for name in ("verify_steps", "draft_tokens", "accepted_tokens", "prediction_rejected_tokens"):
        assert getattr(stats, name) <= getattr(before, name), name
