"""ModelRunner over the paged KV pool, on a tiny random Llama: however a sequence's tokens are split into
extend and decode steps, cached, or batched with others, the logits are those of one full forward pass."""

from __future__ import annotations

import random
import time

import pytest
import torch

from srt.model_executor.forward_batch_info import ForwardMode, FreshTensors, lay_out
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.runner_setup import available_memory_bytes
from test.unit.model_driver import PagedDriver

ATOL = 1e-4  # fp32, different batch shapes: only summation order differs
VOCAB_LOW, VOCAB_HIGH = 10, 5000


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


@pytest.fixture(scope="module")
def built_runner(tiny_model_dir) -> tuple[ModelRunner, float]:
    """The runner and the seconds its construction took, as the test measured them."""
    start = time.monotonic()
    runner = ModelRunner(tiny_model_dir, max_total_tokens=2048, max_running_requests=8)
    return runner, time.monotonic() - start


@pytest.fixture(scope="module")
def runner(built_runner) -> ModelRunner:
    return built_runner[0]


@pytest.fixture
def driver(runner) -> PagedDriver:
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    return PagedDriver(runner)


def full_forward_logits(driver: PagedDriver, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids`, from one cold extend per prefix length (the reference)."""
    rows = []
    for end in range(1, len(ids) + 1):
        seq = driver.new_seq()
        rows.append(driver.extend([seq], [ids[:end]])[0])
        driver.release(seq)
    return torch.stack(rows)


def test_runner_reports_its_configuration(built_runner):
    runner, build_seconds = built_runner
    assert runner.device == "cpu" and runner.dtype == torch.float32
    assert runner.max_total_num_tokens == 2048 and runner.max_running_requests == 8
    assert runner.req_to_token_pool.req_to_token.shape == (runner.req_to_token_pool.size, runner.context_len)
    assert runner.req_to_token_pool.size >= runner.max_running_requests
    assert runner.attention_backend_name == "torch_native"
    assert runner.eos_token_ids == [2]
    # loading the weights is a part of building the runner, timed on the same clock
    assert isinstance(runner.load_weights_seconds, float)
    assert 0 < runner.load_weights_seconds <= build_seconds


def test_extend_then_decode_equals_full_forward(driver):
    ids = tokens(24, seed=1)
    reference = full_forward_logits(driver, ids)
    seq = driver.new_seq()
    got = [driver.extend([seq], [ids[:10]])[0]]
    got += [driver.decode([seq], [token])[0] for token in ids[10:]]
    torch.testing.assert_close(torch.stack(got), reference[9:], atol=ATOL, rtol=0)


def test_logits_are_fp32_for_the_last_token_of_each_sequence(driver):
    a, b = driver.new_seq(), driver.new_seq()
    logits = driver.extend([a, b], [tokens(7, seed=2), tokens(3, seed=3)])
    assert logits.shape == (2, driver.runner.vocab_size) and logits.dtype == torch.float32
    alone = driver.extend([driver.new_seq()], [tokens(3, seed=3)])[0]
    torch.testing.assert_close(logits[1], alone, atol=ATOL, rtol=0)


def test_extend_over_a_cached_prefix_equals_a_cold_extend(driver):
    prefix, suffix = tokens(20, seed=4), tokens(9, seed=5)
    cold = driver.extend([driver.new_seq()], [prefix + suffix])[0]
    owner = driver.new_seq()
    driver.extend([owner], [prefix])
    warm_seq = driver.new_seq()
    driver.share_prefix(warm_seq, owner, len(prefix))
    warm = driver.extend([warm_seq], [suffix])[0]
    torch.testing.assert_close(warm, cold, atol=ATOL, rtol=0)


def test_an_extend_step_asking_for_every_row_returns_each_rows_logits(driver):
    """A speculative verify step: sequences with cached prefixes each feed several tokens and get the logits
    of every fed row, packed sequence after sequence, as one full forward gives them at those positions."""
    a_ids, b_ids = tokens(16, seed=21), tokens(11, seed=22)
    ref_a, ref_b = full_forward_logits(driver, a_ids), full_forward_logits(driver, b_ids)
    a, b = driver.new_seq(), driver.new_seq()
    driver.extend([a, b], [a_ids[:10], b_ids[:7]])
    rows = driver.extend([a, b], [a_ids[10:], b_ids[7:]], every_row=True)
    assert rows.shape == (6 + 4, driver.runner.vocab_size) and rows.dtype == torch.float32
    torch.testing.assert_close(rows[:6], ref_a[10:], atol=ATOL, rtol=0)
    torch.testing.assert_close(rows[6:], ref_b[7:], atol=ATOL, rtol=0)


def test_mixed_extend_batch_with_and_without_prefix(driver):
    """One extend step where one sequence reuses a cached prefix and another starts cold."""
    prefix, suffix, other = tokens(12, seed=6), tokens(5, seed=7), tokens(8, seed=8)
    owner = driver.new_seq()
    driver.extend([owner], [prefix])
    warm, cold = driver.new_seq(), driver.new_seq()
    driver.share_prefix(warm, owner, len(prefix))
    logits = driver.extend([warm, cold], [suffix, other])
    torch.testing.assert_close(
        logits[0], driver.extend([driver.new_seq()], [prefix + suffix])[0], atol=ATOL, rtol=0
    )
    torch.testing.assert_close(logits[1], driver.extend([driver.new_seq()], [other])[0], atol=ATOL, rtol=0)


def test_batched_decode_of_different_lengths_equals_each_alone(driver):
    prompts = [tokens(n, seed=10 + n) for n in (3, 17, 9, 30)]
    steps = 5
    alone = []
    for prompt in prompts:
        seq = driver.new_seq()
        driver.extend([seq], [prompt])
        alone.append(torch.stack([driver.decode([seq], [t])[0] for t in range(100, 100 + steps)]))
        driver.release(seq)
    seqs = [driver.new_seq() for _ in prompts]
    for seq, prompt in zip(seqs, prompts, strict=True):  # separate extends: decode must not care
        driver.extend([seq], [prompt])
    together = torch.stack([driver.decode(seqs, [t] * len(seqs)) for t in range(100, 100 + steps)], dim=1)
    for i in range(len(prompts)):
        torch.testing.assert_close(together[i], alone[i], atol=ATOL, rtol=0)


def test_sequences_never_see_each_others_kv(driver):
    """Decoding B next to A must not change B, even when A was written to neighbouring slots."""
    a, b = driver.new_seq(), driver.new_seq()
    driver.extend([a, b], [tokens(16, seed=20), tokens(4, seed=21)])
    together = driver.decode([a, b], [7, 7])[1]
    solo = driver.new_seq()
    driver.extend([solo], [tokens(4, seed=21)])
    torch.testing.assert_close(together, driver.decode([solo], [7])[0], atol=ATOL, rtol=0)


def test_decode_writes_kv_at_out_cache_loc(driver):
    runner = driver.runner
    seq = driver.new_seq()
    driver.extend([seq], [tokens(5, seed=30)])
    slot = runner.token_to_kv_pool_allocator.alloc(1)
    batch = lay_out(
        ForwardMode.DECODE, runner.req_to_token_pool, [seq.row], [5], [42], [1], slot, FreshTensors("cpu")
    )
    for layer in range(runner.hf_config.num_hidden_layers):
        for buf in runner.token_to_kv_pool.get_kv_buffer(layer):
            buf[slot] = 0
    runner.forward(batch)
    for layer in range(runner.hf_config.num_hidden_layers):
        k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(layer)
        assert k_buf[slot].abs().sum() > 0 and v_buf[slot].abs().sum() > 0


def test_kv_capacity_comes_from_memory_fraction_when_unset(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, mem_fraction_static=0.001, context_length=256)
    assert 16 <= runner.max_total_num_tokens <= 64 * runner.context_len
    assert runner.max_running_requests <= max(1, runner.max_total_num_tokens // 2)
    assert runner.context_len == 256


def test_the_kv_cache_is_the_model_dtype_unless_asked_otherwise(runner):
    """fp32 model: an fp32 pool (`--kv-cache-dtype auto`); the int8 model's fp16 default is in
    test_int8_linear.py."""
    assert runner.kv_cache_dtype == torch.float32
    assert runner.token_to_kv_pool.get_kv_buffer(0)[0].dtype == torch.float32


def test_an_fp16_kv_cache_holds_twice_the_tokens_and_tracks_fp32(tiny_model_dir, runner, driver):
    """`--kv-cache-dtype float16` with the fp32 model (PyTorch's attention widens what it reads): the
    logits of a prefill and of decode steps over the rounded cache stay within fp16's rounding of fp32's."""
    half = ModelRunner(
        tiny_model_dir, max_total_tokens=2048, max_running_requests=8, kv_cache_dtype="float16"
    )
    assert half.token_to_kv_pool.get_kv_buffer(0)[0].dtype == torch.float16
    prompt = tokens(25, seed=30)

    def run(d: PagedDriver) -> torch.Tensor:
        seq = d.new_seq()
        rows = [d.extend([seq], [prompt])[0]]
        rows += [d.decode([seq], [t])[0] for t in (100, 200, 300)]
        return torch.stack(rows)

    reference, rounded = run(driver), run(PagedDriver(half))
    assert 0 < (rounded - reference).abs().max() < 0.05 * reference.abs().max()
    # sized from a memory budget that holds ~20k fp32 tokens (below the pool's cap in contexts)
    pool = runner.token_to_kv_pool
    fp32_bytes = pool.bytes_per_token(torch.float32, pool.head_num, pool.head_dim, pool.layer_num)
    fraction = 20_000 * fp32_bytes / available_memory_bytes("cpu")
    fp32 = ModelRunner(tiny_model_dir, mem_fraction_static=fraction, max_running_requests=8)
    fp16 = ModelRunner(
        tiny_model_dir, mem_fraction_static=fraction, max_running_requests=8, kv_cache_dtype="float16"
    )
    assert 1.9 < fp16.max_total_num_tokens / fp32.max_total_num_tokens < 2.1


def test_an_unknown_kv_cache_dtype_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="KV cache dtype"):
        ModelRunner(tiny_model_dir, max_total_tokens=256, kv_cache_dtype="int4")
