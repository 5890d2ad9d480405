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
    assert stats.prediction_usage() == {"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 1}


def test_step_totals_count_requests_with_drafts_and_acceptances_per_position():
    step = SpecStepStats.from_counts([3, 0, 2, 3], [3, 0, 1, 0])
    assert step.num_drafts == 3
    assert step.num_draft_tokens == 8
    assert step.num_accepted_tokens == 4
    assert step.accepted_per_position == (2, 1, 1)
