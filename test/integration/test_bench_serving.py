"""A short benchmark against a real srt server: the JSON output is complete and the server's `/metrics`
account of the run agrees with what the client saw."""

from __future__ import annotations

import importlib.util
import json

import pytest

from test.integration.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

NUM_PROMPTS = 3
INPUT_LEN = 32
OUTPUT_LEN = 8


def load_bench_serving():
    spec = importlib.util.spec_from_file_location("bench_serving", REPO_ROOT / "scripts" / "bench_serving.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server  # the run's server view is after minus before: earlier traffic does not count


@pytest.mark.parametrize(
    "backend_args", [["--backend", "srt"], ["--backend", "openai", "--endpoint", "chat"]]
)
def test_short_run_writes_every_requests_timings_and_matches_the_servers_metrics(
    server, tmp_path, backend_args
):
    out = tmp_path / "bench.json"
    argv = [
        "--base-url", server.base_url, *backend_args,
        "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1",
        "--max-concurrency", "2", "--output-file", str(out), "--disable-tqdm",
    ]  # fmt: skip
    assert load_bench_serving().main(argv) == 0

    data = json.loads(out.read_text())
    assert data["args"]["num_prompts"] == NUM_PROMPTS
    [run] = data["runs"]
    assert run["max_concurrency"] == 2
    summary = run["summary"]
    assert summary["completed"] == NUM_PROMPTS and summary["failed"] == 0
    assert summary["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: fixed output length
    assert summary["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert summary["output_throughput"] > 0
    for stat in ("ttft", "tpot", "e2e"):
        assert summary[stat]["p99_ms"] >= summary[stat]["median_ms"] > 0
    # An inter-token gap is 0 where SSE events arrived in one network read (a busy client reads late: seen as a
    # median of exactly 0.0 ms on a loaded 2-core machine); the gaps still add up to the stream's span.
    assert summary["itl"]["p99_ms"] >= summary["itl"]["median_ms"] >= 0

    assert len(run["requests"]) == NUM_PROMPTS
    for req in run["requests"]:
        assert req["success"] and not req["error"]
        assert (req["prompt_len"], req["output_len"]) == (INPUT_LEN, OUTPUT_LEN)
        assert 0 < req["ttft"] <= req["e2e"]
        assert len(req["itl"]) == OUTPUT_LEN - 1 and all(gap >= 0 for gap in req["itl"])
        assert req["ttft"] + sum(req["itl"]) <= req["e2e"] + 1e-9  # the last output arrived before the end
        assert req["tpot"] > 0 and req["start"] >= 0

    server_view = run["server"]
    assert server_view is not None, "srt exposes /metrics, so the run must have a server-side account"
    assert server_view["requests"] == NUM_PROMPTS
    assert server_view["prompt_tokens"] == summary["total_input_tokens"]
    assert server_view["generation_tokens"] == summary["total_output_tokens"]
    client_ttft = sum(r["ttft"] for r in run["requests"]) / NUM_PROMPTS
    client_e2e = sum(r["e2e"] for r in run["requests"]) / NUM_PROMPTS
    # the server cannot see a request before the client sends it nor after the client has its answer
    assert 0 < server_view["ttft_mean"] <= client_ttft
    assert 0 < server_view["e2e_mean"] <= client_e2e
