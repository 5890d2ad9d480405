"""A server with a deliberately small KV pool: overload is queued and retracted, never lost; a client that
disconnects gives its KV back."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest

from test.integration.conftest import running_server

pytestmark = pytest.mark.slow

KV_TOKENS = 512
# ~6x what the pool holds at once (the prompts share prefixes): queued, retracted, re-prefilled
NUM_REQUESTS = 120
MAX_TOKENS = 20
PROMPTS = [
    f"Item {i}: the {w} is"
    for i, w in enumerate(["sky", "sea", "sun", "moon", "tree", "road", "city", "rain"])
]
GREEDY = {"temperature": 0, "ignore_eos": True}
# Generous: a 2-core CPU shared with other jobs decodes slowly.
OVERLOAD_TIMEOUT_SECONDS = 1800
# Token ids of ordinary word pieces in SmolLM2's vocabulary (no special tokens).
FIRST_PLAIN_TOKEN, LAST_PLAIN_TOKEN = 1000, 40000
ABANDONED_PROMPT = 400
# The abandoned request asks for as many tokens as the small server's KV pool holds beyond its prompt: at
# batch 1 on a CPU that is several seconds (over 480 tok/s would be needed to finish within this wait; 3 s
# was once too little on a fast machine, where 400 tokens came back in time).
CLIENT_GIVES_UP_SECONDS = 1.0
ABANDONED_PROMPT_TOKENS = 16
# Seconds the scheduler may take to notice a disconnect and report idle.
ABORT_SETTLE_SECONDS = 15.0


# The default model here is the int8 CPU model, which is batch-invariant (test/unit/test_batch_invariance.py):
# queueing, retraction and re-prefill, prefix-cache hits, chunking and mixed steps cannot change a greedy
# request's tokens, so every overloaded request must reproduce its solo run exactly.
SMALL_SERVER_FLAGS = ("--max-total-tokens", str(KV_TOKENS))


@pytest.fixture(scope="module")
def small_server():
    """Mixed prefill/decode steps on: the CPU default."""
    with running_server(*SMALL_SERVER_FLAGS) as handle:
        yield handle


@pytest.fixture(scope="module")
def unmixed_small_server():
    with running_server(*SMALL_SERVER_FLAGS, "--disable-mixed-chunk") as handle:
        yield handle


def metric(text: str, name: str) -> float:
    """Sum of every sample of `name` (over all label sets) in Prometheus text format."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+|NaN)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def scrape(server) -> str:
    return httpx.get(f"{server.base_url}/metrics", timeout=30).text


def complete(server, prompt: str, max_tokens: int, timeout: float = 300) -> dict:
    r = httpx.post(
        f"{server.openai_base_url}/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, **GREEDY},
        timeout=timeout,
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.timeout(OVERLOAD_TIMEOUT_SECONDS)
@pytest.mark.parametrize("server_fixture", ["small_server", "unmixed_small_server"], ids=["mixed", "unmixed"])
def test_overload_completes_every_request_with_its_solo_output(server_fixture, request):
    small_server = request.getfixturevalue(server_fixture)
    alone = {p: complete(small_server, p, MAX_TOKENS)["choices"][0]["text"] for p in PROMPTS}
    prompt_tokens = complete(small_server, PROMPTS[0], 1)["usage"]["prompt_tokens"]
    assert NUM_REQUESTS * (prompt_tokens + MAX_TOKENS) >= 5 * KV_TOKENS

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
        async with httpx.AsyncClient(timeout=OVERLOAD_TIMEOUT_SECONDS, limits=limits) as client:

            async def one(i: int) -> dict:
                body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, **GREEDY}
                r = await client.post(f"{small_server.openai_base_url}/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()

            return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))

    before = metric(scrape(small_server), "sglang:num_retracted_requests_total")
    results = asyncio.run(run())
    assert len(results) == NUM_REQUESTS
    for i, r in enumerate(results):
        choice = r["choices"][0]
        assert r["usage"]["completion_tokens"] == MAX_TOKENS and choice["finish_reason"] == "length"
        assert choice["text"] == alone[PROMPTS[i % len(PROMPTS)]], f"request {i} differs from its solo run"
    retracted = metric(scrape(small_server), "sglang:num_retracted_requests_total") - before
    print(f"overload: {retracted:.0f} retractions")  # informative; queueing alone may have sufficed


def random_ids(n: int, seed: int) -> list[int]:
    """A prompt of exactly n token ids that shares no prefix with other seeds' prompts."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_PLAIN_TOKEN, LAST_PLAIN_TOKEN) for _ in range(n)]


def test_disconnected_stream_frees_its_kv(small_server):
    aborted0 = metric(scrape(small_server), "sglang:num_aborted_requests_total")
    # The abandoned request holds most of the pool: its long prompt is in the KV cache while it decodes.
    body = {"prompt": random_ids(ABANDONED_PROMPT, 1), "max_tokens": 64, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{small_server.openai_base_url}/completions", json=body, timeout=300) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n >= 4:
                break  # leave mid-stream: closing the response drops the connection
    text = wait_aborted_and_idle(small_server, aborted0)
    # A request needing almost the whole pool now runs without preempting anything.
    retracted = metric(text, "sglang:num_retracted_requests_total")
    big = {"prompt": random_ids(KV_TOKENS - 32, 2), "max_tokens": 16, **GREEDY}
    r = httpx.post(f"{small_server.openai_base_url}/completions", json=big, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert metric(scrape(small_server), "sglang:num_retracted_requests_total") == retracted


def wait_aborted_and_idle(server, aborted_before: float) -> str:
    deadline = time.monotonic() + ABORT_SETTLE_SECONDS
    while True:
        text = scrape(server)
        idle = metric(text, "sglang:num_running_reqs") == 0 and metric(text, "sglang:num_used_tokens") == 0
        if idle and metric(text, "sglang:num_aborted_requests_total") == aborted_before + 1:
            return text
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.5)


def test_non_streaming_client_that_gives_up_is_aborted(small_server):
    aborted0 = metric(scrape(small_server), "sglang:num_aborted_requests_total")
    max_tokens = KV_TOKENS - ABANDONED_PROMPT_TOKENS - 16
    body = {"prompt": random_ids(ABANDONED_PROMPT_TOKENS, 3), "max_tokens": max_tokens, **GREEDY}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small_server.openai_base_url}/completions", json=body, timeout=CLIENT_GIVES_UP_SECONDS)
    wait_aborted_and_idle(small_server, aborted0)
