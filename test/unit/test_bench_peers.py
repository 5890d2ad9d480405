"""The peer comparison's pure parts: how each peer is started and talked to, and the ratio table."""

import math

import pytest

from srt_bench.peers import (
    comparison_table,
    llama_cpp_peer,
    median_runs,
    rounds_table,
    srt_before_peer,
    srt_peer,
    transformers_peer,
)
from srt_bench.runner import RunResult
from srt_bench.stats import RequestResult, summarize


def run_at(concurrency, output_tokens, ttft):
    result = RequestResult(10, output_tokens, success=True, ttft=ttft, e2e=ttft + 1.0, itl=[0.01])
    return RunResult(concurrency, math.inf, [result], summarize([result], 2.0), None)


def test_table_has_a_row_per_server_and_level_and_srt_ratio_rows():
    table = comparison_table(
        {
            "srt": [run_at(1, 40, 0.5), run_at(16, 120, 1.0)],
            "llama.cpp": [run_at(1, 20, 2.0), run_at(16, 30, 4.0)],
        }
    )
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    cells = {(r[0].strip(), r[1].strip()): [c.strip() for c in r[2:]] for r in rows}
    assert cells[("srt", "1")][0] == "20.0"  # 40 tokens over 2 s
    # throughput ratio above 1 and latency ratio below 1 both mean srt is better
    assert cells[("srt ÷ llama.cpp", "1")][:2] == ["2.00x", "0.25x"]
    assert cells[("srt ÷ llama.cpp", "16")][0] == "4.00x"
    assert len(rows) == 6


def test_table_without_srt_has_no_ratio_rows():
    table = comparison_table({"llama.cpp": [run_at(1, 20, 2.0)]})
    assert "÷" not in table


@pytest.mark.parametrize(
    ("factory", "fixed_output", "flag"),
    [
        (srt_peer, "ignore_eos", "srt.launch_server"),
        (transformers_peer, "generation_config", "--continuous-batching"),
        (llama_cpp_peer, "min_tokens", "--interrupt_requests"),
    ],
)
def test_each_peer_gets_its_own_way_of_fixing_the_output_length(factory, fixed_output, flag):
    peer = factory(31234, "/models/x")
    assert peer.target.fixed_output == fixed_output
    assert peer.target.base_url == "http://127.0.0.1:31234"
    assert flag in peer.command and "31234" in peer.command
    assert peer.target.model is None  # transformers serve rejects a model name other than its own


def test_median_runs_take_each_levels_median_run_across_rounds():
    rounds = [
        {"srt": [run_at(1, 40, 0.5), run_at(64, 200, 1.0)]},
        {"srt": [run_at(1, 60, 0.5), run_at(64, 100, 1.0)]},
        {"srt": [run_at(1, 20, 0.5), run_at(64, 300, 1.0)]},
    ]
    medians = median_runs(rounds)
    assert [r.max_concurrency for r in medians["srt"]] == [1, 64]
    assert [r.summary.output_throughput for r in medians["srt"]] == [20.0, 100.0]  # tokens over 2 s
    even = median_runs(rounds[:2])  # the lower middle one: never a figure better than half the runs
    assert [r.summary.output_throughput for r in even["srt"]] == [20.0, 50.0]


def test_rounds_table_shows_every_round_and_the_ratio_within_each_round():
    rounds = [
        {"srt": [run_at(64, 200, 1.0)], "llama.cpp": [run_at(64, 40, 5.0)]},
        {"srt": [run_at(64, 180, 1.0)], "llama.cpp": [run_at(64, 60, 5.0)]},
        {"srt": [run_at(64, 220, 1.0)]},  # llama.cpp missing from the last round
    ]
    rows = [line.split("|")[1:-1] for line in rounds_table(rounds).splitlines()[2:]]
    cells = {(r[0].strip(), r[1].strip()): [c.strip() for c in r[2:]] for r in rows}
    assert cells[("srt", "64")] == ["100.0", "90.0", "110.0", "100.0"]
    assert cells[("llama.cpp", "64")] == ["20.0", "30.0", "-", "20.0"]
    assert cells[("srt ÷ llama.cpp", "64")] == ["5.00x", "3.00x", "-", "5.00x"]


def test_the_before_peer_runs_another_trees_srt_with_its_own_cache(tmp_path):
    """Two versions compared in one run: the same command as srt's, started from the other checkout (whose
    `python -m srt.launch_server` imports its own srt), kernels and calibrations kept apart."""
    (tmp_path / "srt").mkdir()
    peer = srt_before_peer(31234, "/models/x", tree=str(tmp_path))
    assert peer.name == "srt-before" and peer.missing is None
    assert peer.command == srt_peer(31234, "/models/x").command
    assert peer.cwd == str(tmp_path)
    assert peer.env["SRT_CACHE_DIR"].startswith(str(tmp_path))
    assert srt_before_peer(31234, "/models/x", tree=str(tmp_path / "nowhere")).missing
