"""Specification of the lookup proposers: NGRAM (vLLM's prompt-lookup rule over a request's own prompt +
output) and Predicted Outputs (the prediction drafted in step with what was generated), plus the limits a
scheduler applies to every proposer and the flag defaults it reads in a process without torch."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest

from srt.speculative.defaults import (
    NGRAM_MAX_MATCH_WINDOW_SIZE,
    NUM_DRAFT_TOKENS,
    PREDICTION_MIN_MATCH,
    SHORT_MATCH_DRAFTS,
    SHORT_MATCH_TOKENS,
    drafts_per_step,
)
from srt.speculative.lookup import EVERY_MATCH_DRAFTS_K, DraftLength
from srt.speculative.ngram import NgramProposer, prompt_lookup
from srt.speculative.prediction import PredictionProposer
from srt.speculative.proposer import draft_len_limit


@dataclass
class FakeReq:
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    prediction_ids: list[int] | None = None


def lookup(
    tokens: list[int], min_n: int = 1, max_n: int = 12, k: int = 8, length: DraftLength = EVERY_MATCH_DRAFTS_K
) -> list[int]:
    return prompt_lookup(np.asarray(tokens, dtype=np.int32), min_n, max_n, k, length).tolist()


def reference_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule written out: longest n first, then the earliest occurrence ending before the last token."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for end in range(n - 1, total - 1):
            if tokens[end - n + 1 : end + 1] == tokens[total - n :]:
                return tokens[end + 1 : end + 1 + k]
    return []


# ---- NGRAM ----


def test_no_earlier_occurrence_of_the_last_token_gives_no_draft():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([7]) == []
    assert lookup([]) == []


def test_the_longest_matching_ngram_wins_over_an_earlier_shorter_one():
    # suffix [7, 8, 9, 5]: "5" alone occurs first (followed by 50), "8 9 5" later (followed by 60)
    history = [5, 50, 8, 9, 5, 60, 7, 8, 9, 5]
    assert lookup(history, k=5) == [60, 7, 8, 9, 5]


def test_among_equally_long_matches_the_earliest_is_continued():
    history = [1, 2, 10, 1, 2, 20, 1, 2]
    assert lookup(history, k=1) == [10]


def test_matches_are_capped_at_max_n_so_the_earliest_capped_match_wins():
    history = [1, 2, 10, 7, 1, 2, 20, 7, 1, 2]
    assert lookup(history, max_n=2, k=1) == [10]  # "1 2" first occurs before 10
    assert lookup(history, max_n=3, k=1) == [20]  # "7 1 2" occurs only before 20


def test_min_n_is_respected():
    history = [3, 40, 41, 9, 3]  # only the one-token suffix "3" occurs earlier
    assert lookup(history, min_n=1, k=2) == [40, 41]
    assert lookup(history, min_n=2, k=2) == []


def test_the_draft_is_capped_at_k():
    history = [1, 2, 3, 4, 5, 6, 7, 1]
    assert lookup(history, k=3) == [2, 3, 4]
    assert lookup(history, k=0) == []


def test_the_draft_stops_where_the_history_ends():
    assert lookup([4, 5, 6, 5], k=8) == [6, 5]
    # a match overlapping the suffix itself: a repeated token drafts itself
    assert lookup([1, 1, 1, 1], max_n=3, k=8) == [1]


def test_the_vectorized_search_agrees_with_the_rule_written_out():
    rng = random.Random(29)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(0, 5)
        assert lookup(tokens, min_n, max_n, k) == reference_lookup(tokens, min_n, max_n, k), (
            tokens,
            min_n,
            max_n,
        )


def test_proposer_searches_prompt_and_output_and_follows_appended_tokens():
    proposer = NgramProposer(min_n=1, max_n=4, k=3)
    req = FakeReq("a", [10, 11, 12, 13, 14, 15], [20, 10, 11])
    assert proposer.propose([req], [3]).token_ids == [
        [12, 13, 14]
    ]  # "10 11" of the output found in the prompt
    req.output_ids += [12, 30]  # accepted one draft, then a new token
    assert proposer.propose([req], [3]).token_ids == [[]]
    req.output_ids += [20]
    assert proposer.propose([req], [3]).token_ids == [[10, 11, 12]]


def test_each_request_gets_at_most_its_own_limit():
    proposer = NgramProposer(min_n=1, max_n=4, k=3)
    reqs = [FakeReq("a", [1, 2, 3, 4, 5, 1]), FakeReq("b", [1, 2, 3, 4, 5, 1]), FakeReq("c", [9, 8])]
    drafts = proposer.propose(reqs, [2, 0, 3])
    assert drafts.token_ids == [[2, 3], [], []]
    assert drafts.lengths == [2, 0, 0] and drafts.num_tokens == 2 and drafts.max_len == 2
    assert drafts.probs is None  # lookup drafts are point masses


def test_the_proposer_keeps_one_history_per_request_until_released():
    proposer = NgramProposer(min_n=1, max_n=4, k=2)
    proposer.propose([FakeReq("a", [1, 2, 1]), FakeReq("b", [3, 4, 3])], [2, 2])
    assert len(proposer.histories) == 2
    proposer.release("a")
    assert len(proposer.histories) == 1
    # the same rid reused for another request is rebuilt, not confused with the old one
    assert proposer.propose([FakeReq("b", [5, 6, 7, 5])], [2]).token_ids == [[6, 7]]


def test_the_incremental_history_equals_a_fresh_conversion_over_a_long_generation():
    rng = random.Random(7)
    proposer = NgramProposer(min_n=1, max_n=5, k=4)
    req = FakeReq("a", [rng.randrange(20) for _ in range(300)])
    for _ in range(200):
        req.output_ids += [rng.randrange(20) for _ in range(rng.randint(1, 4))]
        got = proposer.propose([req], [4]).token_ids[0]
        assert got == lookup(req.origin_input_ids + req.output_ids, 1, 5, 4, proposer.length)


def test_a_short_match_drafts_a_few_tokens_and_a_long_one_drafts_k():
    """A match of fewer than SHORT_MATCH_TOKENS tokens is often a coincidence: it drafts at most
    SHORT_MATCH_DRAFTS; the proposer's default length applies the rule, the bare lookup does not."""
    assert DraftLength()(SHORT_MATCH_TOKENS - 1, 8) == SHORT_MATCH_DRAFTS == 3
    assert DraftLength()(SHORT_MATCH_TOKENS, 8) == 8 and DraftLength()(1, 2) == 2
    assert EVERY_MATCH_DRAFTS_K(1, 8) == 8
    proposer = NgramProposer(min_n=1, max_n=12, k=8)
    follow = list(range(100, 120))
    short = FakeReq("short", [5, 6] + follow, [70, 5, 6])  # the last 2 tokens match
    long = FakeReq("long", [1, 2, 3, 4] + follow, [70, 1, 2, 3, 4])  # the last 4 tokens match
    assert proposer.propose([short, long], [8, 8]).token_ids == [follow[:SHORT_MATCH_DRAFTS], follow[:8]]
    assert lookup(short.origin_input_ids + short.output_ids, 1, 12, 8) == follow[:8]


def test_window_sizes_are_checked():
    with pytest.raises(ValueError):
        NgramProposer(min_n=0, max_n=3)
    with pytest.raises(ValueError):
        NgramProposer(min_n=4, max_n=3)


# ---- Predicted Outputs ----


def predict(
    proposer: PredictionProposer, prediction: list[int], output: list[int], limit: int = 4
) -> list[int]:
    req = FakeReq("p", [900, 901], list(output), prediction)
    return proposer.propose([req], [limit]).token_ids[0]


def test_an_exact_copy_of_the_prediction_is_drafted_entirely_at_every_step():
    rng = random.Random(3)
    block = [rng.randrange(50) for _ in range(8)]
    prediction = block + [rng.randrange(50) for _ in range(10)] + block + [1, 2, 3]  # a repeated block
    # a window shorter than the block: ties happen (every match drafts k: the alignment alone is tested)
    proposer = PredictionProposer(min_n=1, max_n=3, k=4, length=EVERY_MATCH_DRAFTS_K)
    for produced in range(len(prediction) + 1):
        expected = prediction[produced : produced + 4]
        assert predict(proposer, prediction, prediction[:produced]) == expected, produced


def test_after_an_edit_drafting_resynchronises_just_past_the_changed_span():
    prediction = list(range(100, 160))
    edited = prediction[:20] + [1, 2, 3] + prediction[25:]  # five tokens replaced by three
    proposer = PredictionProposer(min_n=1, max_n=12, k=4, length=EVERY_MATCH_DRAFTS_K)
    for produced in range(len(edited) + 1):
        draft = predict(proposer, prediction, edited[:produced])
        if produced <= 20:  # the prediction as it stands, the edit is not known yet
            assert draft == prediction[produced : produced + 4], produced
        elif produced <= 23:  # inside the inserted span nothing of the prediction matches
            assert draft == [], produced
        else:  # from the first predicted token after the span on, the edited text exactly
            assert draft == edited[produced : produced + 4], produced


def test_after_an_edit_a_prediction_realigns_on_its_own_window_and_drafts_k_at_once():
    """The prediction's defaults: a 3-token tail realigns it (not NGRAM's window), and it drafts k from the
    first step back on the text; NGRAM's short-match rule does not apply to a client's own text."""
    prediction = list(range(100, 160))
    edited = prediction[:20] + [1, 2, 3] + prediction[25:]
    proposer = PredictionProposer(k=7)
    assert (
        (proposer.min_n, proposer.length)
        == (PREDICTION_MIN_MATCH, EVERY_MATCH_DRAFTS_K)
        == (3, EVERY_MATCH_DRAFTS_K)
    )
    for produced in range(24, 24 + PREDICTION_MIN_MATCH - 1):  # fewer than 3 tokens back on the text
        assert predict(proposer, prediction, edited[:produced], limit=7) == [], produced
    for produced in range(24 + PREDICTION_MIN_MATCH - 1, 32):
        assert predict(proposer, prediction, edited[:produced], limit=7) == edited[produced : produced + 7]


def test_where_the_prediction_has_nothing_the_requests_own_tokens_draft_unflagged():
    """Inside an edit the prediction drafts nothing; if the output is copying its prompt there, NGRAM's
    lookup over the request's own tokens drafts instead, and `from_prediction` says so (OpenAI's prediction
    token counts leave those drafts out). With `own_tokens=None` the prediction alone drafts."""
    quoted = list(range(300, 320))
    prediction = list(range(100, 140))
    req = FakeReq("p", [7, 8] + quoted + [9], prediction[:10] + quoted[:6], prediction)
    drafts = PredictionProposer(k=4).propose([req], [4])
    assert drafts.token_ids == [quoted[6:10]] and drafts.from_prediction == (False,)
    assert PredictionProposer(k=4, own_tokens=None).propose([req], [4]).token_ids == [[]]
    on_text = FakeReq("q", [7, 8] + quoted, prediction[:12], prediction)
    drafts = PredictionProposer(k=4).propose([on_text], [4])
    assert drafts.token_ids == [prediction[12:16]] and drafts.from_prediction == (True,)


def test_requests_without_prediction_or_budget_get_no_draft():
    proposer = PredictionProposer(k=4)
    reqs = [FakeReq("a", [1], [], None), FakeReq("b", [1], [], []), FakeReq("c", [1], [], [5, 6, 7])]
    assert proposer.propose(reqs, [4, 4, 0]).token_ids == [[], [], []]
    assert proposer.propose(reqs[2:], [2]).token_ids == [[5, 6]]


def test_the_prediction_is_converted_once_and_released():
    proposer = PredictionProposer(k=2)
    req = FakeReq("a", [1], [], [5, 6, 7])
    proposer.propose([req], [2])
    req.prediction_ids = [8, 9]  # a proposer reads a request's prediction once
    assert proposer.propose([req], [2]).token_ids == [[5, 6]]
    proposer.release("a")
    assert proposer.propose([req], [2]).token_ids == [[8, 9]]


# ---- limits and defaults ----


def test_a_verify_step_never_takes_the_request_past_its_token_budget():
    # the step appends accepted drafts + 1 token, so a budget of n allows n - 1 drafts
    assert draft_len_limit(5, tokens_left=100) == 5
    assert draft_len_limit(5, tokens_left=3) == 2
    assert draft_len_limit(5, tokens_left=1) == 0
    assert draft_len_limit(5, tokens_left=0) == 0


def test_the_proposer_and_the_server_share_the_defaults_and_count_the_verified_root():
    from srt.server_args import ServerArgs

    assert drafts_per_step(NUM_DRAFT_TOKENS) == NUM_DRAFT_TOKENS - 1 == NgramProposer().k
    args = ServerArgs(speculative_algorithm="NGRAM")
    assert args.speculative_drafts_per_step == NgramProposer().k
    assert (
        args.speculative_ngram_max_match_window_size == NGRAM_MAX_MATCH_WINDOW_SIZE == NgramProposer().max_n
    )
    assert args.speculative_ngram_min_match_window_size == NgramProposer().min_n


def test_the_defaults_load_without_torch():
    code = "import sys, srt.speculative.defaults; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
