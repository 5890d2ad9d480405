"""`--tp-size 2` on the CPU: one model sharded over two gloo ranks behind one HTTP server. It answers exactly
as one rank does, reports its scheduler metrics once (as `tp_rank="0"`), stops cleanly on SIGTERM, and goes
down loudly when a rank dies."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from srt.metrics.text_format import parse_metrics_text, select, total
from test.integration.conftest import flush_cache, launch_server
from test.integration.test_server_faults import wait_gone, wait_session_empty

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Request number 7 says"]
MAX_TOKENS = 12
PEER = "srt-sched-tp1"
# The launcher must be gone this soon after a rank dies (as after any child's death).
EXIT_AFTER_PEER_DEATH_SECONDS = 15.0


def greedy_outputs(server) -> list:
    """Native /generate token ids and OpenAI completion texts, the requests sent concurrently so that
    they share batches."""
    client = server.openai_client(timeout=120)
    model = client.models.list().data[0].id

    def native(prompt: str) -> list[int]:
        params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(
            f"{server.base_url}/generate", json={"text": prompt, "sampling_params": params}, timeout=120
        )
        r.raise_for_status()
        return r.json()["output_ids"]

    def completion(prompt: str) -> str:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        ids = list(pool.map(native, PROMPTS))
        texts = list(pool.map(completion, PROMPTS))
    return [ids, texts]


@pytest.fixture(scope="module")
def one_rank_outputs(tiny_fp32_server) -> list:
    # fp32 on both sides: int8 quantizes each rank's shard on its own, so tp=2 int8 is not bit-equal to
    # tp=1 (test_tensor_parallel.py checks int8 ranks against fp32 instead)
    flush_cache(tiny_fp32_server)
    return greedy_outputs(tiny_fp32_server)


def test_two_ranks_answer_as_one_report_once_and_stop_cleanly(tiny_model_dir, one_rank_outputs):
    server = launch_server("--model-path", tiny_model_dir, "--tp-size", "2", "--quantization", "none")
    try:
        children = server.child_pids()
        assert {"srt-scheduler", PEER} <= set(children)
        assert greedy_outputs(server) == one_rank_outputs

        samples = parse_metrics_text(httpx.get(f"{server.base_url}/metrics", timeout=10).text)
        assert select(samples, "sglang:num_running_reqs", tp_rank="0")
        assert total(samples, "sglang:realtime_tokens_total", mode="decode", tp_rank="0") > 0
        # a process without a rank (HTTP, detokenizer) carries an empty tp_rank
        assert not [s for s in samples if s.labels.get("tp_rank") not in (None, "", "0")], (
            "only rank 0 reports"
        )

        tree = [server.proc.pid, *children.values()]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert wait_gone(tree, 5) == []
        assert wait_session_empty(server.proc.pid) == []
    finally:
        server.stop(signal.SIGKILL)


def test_a_dead_rank_takes_the_server_down(tiny_model_dir):
    server = launch_server("--model-path", tiny_model_dir, "--tp-size", "2")
    try:
        children = server.child_pids()
        killed_at = time.monotonic()
        os.kill(children[PEER], signal.SIGKILL)
        server.proc.wait(EXIT_AFTER_PEER_DEATH_SECONDS)
        assert time.monotonic() - killed_at < EXIT_AFTER_PEER_DEATH_SECONDS
        assert server.proc.returncode not in (0, None)
        assert wait_session_empty(server.proc.pid) == []
        assert f"TP peer {PEER}" in server.logs() and "died" in server.logs()
    finally:
        server.stop(signal.SIGKILL)
