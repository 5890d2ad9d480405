"""The int8 CPU model is batch-invariant: a sequence's logits are the same to the bit however the scheduler
ran it. Its linear layers multiply integers exactly, its norms and activations work row by row, and extend
and decode attention share one order of operations per token (`cpu_attention_kernels.c`). So a greedy request's
output cannot depend on chunked prefill, a prefix-cache hit, retraction and re-prefill, mixed steps, or
what else was running: what users of a server rightly expect, and what the overload test relies on."""

from __future__ import annotations

import random

import pytest
import torch

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.model_runner import ModelRunner
from test.unit.model_driver import PagedDriver

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="srt's CPU kernels do not load here")

VOCAB_LOW, VOCAB_HIGH = 10, 5000


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


@pytest.fixture(scope="module")
def runner(tiny_model_dir, tmp_path_factory) -> ModelRunner:
    mp = pytest.MonkeyPatch()
    mp.setenv("SRT_CACHE_DIR", str(tmp_path_factory.mktemp("int8_cache")))
    runner = ModelRunner(
        tiny_model_dir, max_total_tokens=4096, max_running_requests=8, quantization="w8a8_int8"
    )
    mp.undo()
    assert runner.model.attn_backend.cpu_kernels is not None
    return runner


@pytest.fixture
def driver(runner) -> PagedDriver:
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    return PagedDriver(runner)


PROMPT = tokens(41, seed=1)


def cold(driver: PagedDriver, ids: list[int]) -> torch.Tensor:
    return driver.extend([driver.new_seq()], [ids])[0]


def test_a_prompt_split_into_chunks_gives_the_logits_of_one_prefill(driver):
    whole = cold(driver, PROMPT)
    for cuts in ([1], [16], [7, 8, 40], list(range(1, 41, 5))):
        seq = driver.new_seq()
        bounds = [0, *cuts, len(PROMPT)]
        for a, b in zip(bounds, bounds[1:], strict=False):
            last = driver.extend([seq], [PROMPT[a:b]])[0]
        assert torch.equal(last, whole), cuts


def test_a_prefix_cache_hit_gives_the_logits_of_a_cold_prefill(driver):
    whole = cold(driver, PROMPT)
    owner = driver.new_seq()
    driver.extend([owner], [PROMPT[:30]])
    hit = driver.new_seq()
    driver.share_prefix(hit, owner, 30)
    assert torch.equal(driver.extend([hit], [PROMPT[30:]])[0], whole)


def test_a_retracted_request_re_prefilled_gets_the_logits_it_had_while_decoding(driver):
    """Decoding token by token, then prefilling prompt + output anew (what retraction does), agree."""
    seq = driver.new_seq()
    driver.extend([seq], [PROMPT[:20]])
    decoded = [driver.decode([seq], [t])[0] for t in PROMPT[20:]]
    for end in (21, 33, len(PROMPT)):
        assert torch.equal(cold(driver, PROMPT[:end]), decoded[end - 21]), end


def test_a_sequence_gets_the_same_logits_alone_batched_and_mixed(driver):
    others = [tokens(n, seed=10 + n) for n in (3, 57, 12)]
    alone = cold(driver, PROMPT)
    together = driver.extend([driver.new_seq() for _ in range(4)], [others[0], PROMPT, *others[1:]])
    assert torch.equal(together[1], alone)
    # decode PROMPT's last token next to sequences of other lengths, and inside a mixed step
    seq = driver.new_seq()
    driver.extend([seq], [PROMPT[:-1]])
    neighbours = [driver.new_seq() for _ in others]
    driver.extend(neighbours, others)
    batched = driver.decode([neighbours[0], seq, neighbours[1]], [5, PROMPT[-1], 6])[1]
    assert torch.equal(batched, alone)
    seq2 = driver.new_seq()
    driver.extend([seq2], [PROMPT[:-1]])
    newcomer = driver.new_seq()
    mixed = driver.mixed([newcomer], [tokens(33, seed=5)], [neighbours[2], seq2], [7, PROMPT[-1]])
    assert torch.equal(mixed[2], alone)
