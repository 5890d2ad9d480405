"""`--speculative-*` flags (docs/speculative_decoding.md): SGLang's names and counting, and a bad value or an
algorithm srt does not run refused at start-up in one line."""

from __future__ import annotations

import pytest

from srt.server_args import ServerArgs
from srt.speculative.defaults import NUM_DRAFT_TOKENS


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"speculative_algorithm": "STANDALONE"}, ["STANDALONE needs --speculative-draft-model-path"]),
        ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "."}, ["read only with"]),
        (
            {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/no/such/model"},
            ["--speculative-draft-model-path '/no/such/model' does not exist"],
        ),
        ({"speculative_algorithm": "EAGLE"}, ["must be one of", "'EAGLE'"]),
        (
            {"per_request_spec_decode_metrics": "detailed"},
            ["--per-request-spec-decode-metrics", "'detailed'"],
        ),
        ({"speculative_num_draft_tokens": 1}, ["--speculative-num-draft-tokens", ">= 2"]),
        ({"speculative_num_draft_tokens": True}, ["--speculative-num-draft-tokens", "integer"]),
        ({"speculative_ngram_min_match_window_size": 0}, ["min-match-window-size", ">= 1"]),
        (
            {"speculative_ngram_min_match_window_size": 5, "speculative_ngram_max_match_window_size": 3},
            ["(5) must not exceed", "(3)"],
        ),
    ],
)
def test_bad_speculative_flags_are_refused_in_one_line(flags, words):
    with pytest.raises(ValueError) as e:
        ServerArgs(**flags)
    assert "\n" not in str(e.value)
    for word in words:
        assert word in str(e.value)


def test_the_flags_parse_under_sglangs_names():
    args = ServerArgs.parse(
        [
            "--speculative-algorithm", "NGRAM",
            "--speculative-num-draft-tokens", "5",
            "--speculative-ngram-min-match-window-size", "2",
            "--speculative-ngram-max-match-window-size", "8",
        ]
    )  # fmt: skip
    assert args.speculative_algorithm == "NGRAM"
    assert (args.speculative_num_draft_tokens, args.speculative_ngram_min_match_window_size) == (5, 2)
    assert args.speculative_ngram_max_match_window_size == 8


def test_drafts_per_step_follow_sglangs_counting():
    """N positions a step, the verified token included, are N - 1 drafts; unset, N is the max match window."""
    assert ServerArgs().speculative_drafts_per_step == 0  # off
    spec = ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    assert spec.speculative_drafts_per_step == 4
    unset = ServerArgs(speculative_algorithm="NGRAM")
    assert unset.speculative_drafts_per_step == NUM_DRAFT_TOKENS - 1


def verify_budget(device: str, graph_max_bs: int = 0) -> int:
    """The scheduler's verify budget on a runner on `device` replaying decode graphs up to `graph_max_bs`
    rows, as it reads it (`ModelRunner.verify_max_tokens`)."""
    from types import SimpleNamespace

    from srt.model_executor.model_runner import ModelRunner
    from srt.scheduler.spec_step import verify_step_tokens

    runner = SimpleNamespace(device=device, decode_graph_max_bs=graph_max_bs)
    return verify_step_tokens(ModelRunner.verify_max_tokens.fget(runner))


@pytest.mark.parametrize(
    "batch, drafts", [(1, 11), (2, 7), (3, 4), (4, 3), (8, 1), (9, 0), (16, 0), (256, 0)]
)
def test_drafts_shrink_as_the_batch_grows_and_stop_past_it(batch, drafts):
    """A CPU verify step feeds at most what the fused CPU step takes (16 tokens): batch x (1 + drafts)."""
    from srt.speculative.defaults import drafts_for_batch

    budget = verify_budget("cpu")
    assert drafts_for_batch(11, batch, budget) == drafts
    assert batch * (1 + drafts) <= budget or drafts == 0


def test_a_gpu_verify_step_may_feed_more_tokens_than_a_cpu_one():
    """On the CPU a verify row past the fused step's 16 costs about a prompt token; on a GPU it costs little."""
    from srt.model_executor.models.cpu_decode import EXTEND_MAX_TOKENS
    from srt.speculative.defaults import GPU_VERIFY_STEP_TOKENS

    assert verify_budget("cpu") == EXTEND_MAX_TOKENS
    assert verify_budget("cuda:0") == GPU_VERIFY_STEP_TOKENS > EXTEND_MAX_TOKENS


@pytest.mark.parametrize("graph_max_bs", [8, 160])
def test_with_decode_graphs_a_gpu_verify_step_stays_within_the_largest_graph(graph_max_bs):
    """Verify rows replay as a decode step of as many rows; one more row than the largest graph would run
    the step eagerly, several times a replayed step's cost."""
    from srt.speculative.defaults import GPU_VERIFY_STEP_TOKENS

    assert verify_budget("cuda:0", graph_max_bs) == min(graph_max_bs, GPU_VERIFY_STEP_TOKENS)
