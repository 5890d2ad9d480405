"""The speculative decoding benchmark's workload and its pure parts: the grounded prompts quote the text their
answers should copy, fit the small model's budget, and the script's flags and server commands are what the
benchmark claims to run."""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib.util
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

from srt_bench import grounded, runner, spec_report
from srt_bench.backends import Target
from srt_bench.grounded import (
    ACCEPTED_METRIC,
    DRAFTS_METRIC,
    KINDS,
    OPEN_QUESTIONS,
    SpecFigures,
    SpecRequest,
    check_record,
    identical_outputs,
    load_records,
)
from srt_bench.runner import RunResult
from srt_bench.stats import RequestResult, summarize

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "scripts" / "data" / "grounded_prompts.jsonl"
MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS = 150, 700
MIN_PER_KIND = 20


@functools.cache
def load_script():
    """scripts/bench_spec.py as a module, registered first: its dataclasses look their module up by name."""
    spec = importlib.util.spec_from_file_location("bench_spec", ROOT / "scripts" / "bench_spec.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def records():
    return load_records(str(WORKLOAD))


def test_the_workload_has_at_least_twenty_prompts_of_each_kind(records):
    kinds = Counter(r["kind"] for r in records)
    assert set(kinds) == set(KINDS)
    assert all(count >= MIN_PER_KIND for count in kinds.values())
    assert len(records) >= len(KINDS) * MIN_PER_KIND


def test_every_original_is_quoted_verbatim_in_its_prompt_and_used_once(records):
    assert all(r["original"] in r["prompt"] for r in records)
    originals = [r["original"] for r in records]
    assert len(set(originals)) == len(originals)  # no prompt gets a prefix-cache head start from another


def test_the_first_prompts_mix_the_kinds(records):
    """--num-prompts takes the first N: a short run still measures every kind."""
    assert {r["kind"] for r in records[: len(KINDS)]} == set(KINDS)


def test_every_function_to_edit_is_valid_python_of_ten_to_thirty_lines(records):
    for r in records:
        if r["kind"] == "edit_function":
            ast.parse(r["original"])
            assert 10 <= len(r["original"].splitlines()) <= 30


@pytest.mark.slow
def test_prompts_fit_the_token_budget_under_the_embedded_tokenizer(records):
    from srt_bench.dataset import load_tokenizer
    from srt_bench.grounded import grounded_requests

    requests = grounded_requests(records, load_tokenizer(None), max_tokens=256)
    lengths = [r.prompt_len for r in requests]
    assert MIN_PROMPT_TOKENS <= min(lengths) and max(lengths) <= MAX_PROMPT_TOKENS


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"original": "not in the prompt"}, "verbatim"),
        ({"kind": "summarise"}, "kind"),
        ({"extra": 1}, "keys"),
    ],
)
def test_a_broken_record_is_refused(change, complaint):
    record = {
        "kind": "quote_passage",
        "prompt": "Quote this: the sky is blue.",
        "original": "the sky is blue.",
    }
    check_record(record)
    with pytest.raises(ValueError, match=complaint):
        check_record({**record, **change})


def test_only_a_grounded_request_carries_a_prediction():
    grounded = SpecRequest("Edit: x = 1", 5, 16, "edit_function", "x = 1")
    assert grounded.prediction_fields == {"prediction": {"type": "content", "content": "x = 1"}}
    assert SpecRequest(OPEN_QUESTIONS[0], 10, 16).prediction_fields == {}


def test_acceptance_length_is_one_plus_accepted_per_draft_over_the_run():
    before = {DRAFTS_METRIC: 10.0, ACCEPTED_METRIC: 5.0}
    after = {DRAFTS_METRIC: 30.0, ACCEPTED_METRIC: 65.0}
    figures = SpecFigures.between(before, after)
    assert (figures.drafts, figures.accepted, figures.accept_length) == (20.0, 60.0, 4.0)
    assert SpecFigures.between(before, before).accept_length is None  # no drafts in the run
    assert SpecFigures.between({}, {"sglang:num_requests_total": 3.0}) is None  # speculation off
    assert SpecFigures.between(None, after) is None  # no /metrics


def run_of(*texts):
    results = [RequestResult(5, 3, success=t is not None, generated_text=t or "") for t in texts]
    return RunResult(1, math.inf, results, summarize(results, 1.0), None)


def test_outputs_are_compared_request_by_request_over_those_both_completed():
    assert identical_outputs(run_of("a", "b", "c"), run_of("a", "B", None)) == (1, 2)


def test_paired_runs_send_each_prompt_to_every_server_in_turn_and_time_each_servers_own_requests(
    monkeypatch,
):
    sent = []

    async def fake_send(session, target, req, count_tokens, start):
        sent.append((target.base_url, req.prompt, "prediction" in target.extra_body))
        await asyncio.sleep(0.02 if target.base_url.endswith("b") else 0.0)
        return RequestResult(req.prompt_len, 10, success=True, generated_text="x")

    monkeypatch.setattr(runner, "send_request", fake_send)
    requests = [SpecRequest(f"p{i}", 5, 16, "edit_function", "x = 1") for i in range(3)]
    targets = [Target("http://a"), Target("http://b")]
    fast, slow = asyncio.run(grounded.run_paired(targets, requests, len, [False, True]))
    assert sent == [(url, f"p{i}", url.endswith("b")) for i in range(3) for url in ("http://a", "http://b")]
    assert len(fast.results) == len(slow.results) == 3
    # each server's duration is its own requests' time: 3 x 20 ms for b, next to nothing for a
    assert fast.summary.output_throughput > 10 * slow.summary.output_throughput
    assert 0.05 < 30 / slow.summary.output_throughput < 0.5


def test_the_script_parses_its_flags():
    args = (
        load_script()
        .build_parser()
        .parse_args(
            [
                "--rounds",
                "3",
                "--num-prompts",
                "12",
                "--output-file",
                "/tmp/spec.json",
                "--peers",
                "srt,srt-ngram",
                "--paired",
            ]
        )
    )
    assert (args.rounds, args.num_prompts, args.output_file, args.peers, args.paired) == (
        3,
        12,
        "/tmp/spec.json",
        "srt,srt-ngram",
        True,
    )
    defaults = load_script().build_parser().parse_args([])
    assert defaults.num_prompts is None and defaults.max_tokens == 256 and defaults.concurrency == "16,64"
    assert not defaults.paired
    assert Path(defaults.workload) == WORKLOAD


def test_each_configuration_starts_the_server_it_names():
    script = load_script()
    args = script.build_parser().parse_args(["--num-draft-tokens", "6", "--lookup-tokens", "8"])
    plain = script.make_peer("srt-prediction", 31000, "/models/x", args)
    assert "--speculative-algorithm" not in plain.command
    ngram = script.make_peer("srt-ngram-prediction", 31001, "/models/x", args).command
    assert ngram[ngram.index("--speculative-algorithm") + 1] == "NGRAM"
    assert ngram[ngram.index("--speculative-num-draft-tokens") + 1] == "6"
    assert "--speculative-ngram-min-match-window-size" not in ngram  # the server's default unless asked
    lookup = script.make_peer("llama.cpp-lookup", 31002, "/models/x", args).command
    assert lookup[lookup.index("--draft_model") + 1] == "prompt-lookup-decoding"
    assert lookup[lookup.index("--draft_model_num_pred_tokens") + 1] == "8"


def test_only_srt_configurations_are_held_to_identical_outputs():
    reference = {"grounded": spec_report.Measurement(run_of("a", "b"), None)}
    rounds = [
        {
            "srt": reference,
            "srt-ngram": {"grounded": spec_report.Measurement(run_of("a", "x"), None)},
            "llama.cpp-lookup": {"grounded": spec_report.Measurement(run_of("q", "r"), None)},
        }
    ]
    assert spec_report.identity_counts(rounds, "srt-ngram", "grounded") == (1, 2)
    assert spec_report.identity_counts(rounds, "llama.cpp-lookup", "grounded") is None
    assert "1 answers differ" in spec_report.targets_checklist(rounds)
