"""On a GPU, srt's model is transformers' model: greedy tokens and logits of a random tiny Llama and of a
random model of SmolLM2's shape, in fp32 and bf16, against transformers on the same weights and the same
GPU; and a decode step replayed from a CUDA graph equals the eager step. Skipped without CUDA (`cuda`)."""

from __future__ import annotations

import random

import pytest
import torch

from srt.model_executor.model_runner import MAX_CONTEXTS_IN_KV_POOL, ModelRunner
from test.unit.model_driver import PagedDriver, same_or_diverged_at_a_near_tie

pytestmark = pytest.mark.cuda

NEW_TOKENS = 12
VOCAB_LOW, VOCAB_HIGH = 100, 5000
# fp32 on both sides differs in summation order only; a greedy choice may flip only at a near-tie this close.
FP32_TIE = 1e-3
# bf16 rounds every activation: srt's and transformers' bf16 logits may each be off by a few hundredths
# (measured against their fp32 logits below), so a flip is legitimate up to this gap.
BF16_TIE = 0.25
# srt in bf16 may be at most this much further from the fp32 reference than transformers in bf16 is
BF16_ERROR_FACTOR = 2.0
BF16_ERROR_FLOOR = 1e-3
MODELS = ["tiny_model_dir", "smollm2_shaped_model_dir"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def hf_model(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float], torch.Tensor]:
    """Greedy tokens, the top-1 minus top-2 logit gap at each step, and the first step's logits."""
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    gaps = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return out.sequences[0, len(prompt) :].tolist(), gaps, out.logits[0][0].float()


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_fixture", MODELS)
def test_greedy_decoding_equals_transformers(request, model_fixture, dtype):
    model_dir = request.getfixturevalue(model_fixture)
    batch = prompts(4, seed=11)
    runner = ModelRunner(
        model_dir, device="cuda", dtype=dtype, max_total_tokens=4096, max_running_requests=8,
        cuda_graph_max_bs=8,
    )  # fmt: skip
    driver = PagedDriver(runner)
    seqs = [driver.new_seq() for _ in batch]
    first_logits = driver.extend(seqs, batch)
    for seq in seqs:
        driver.release(seq)
    traces = driver.greedy(batch, NEW_TOKENS)  # one batched prefill, then decode steps from a graph

    reference = hf_model(model_dir, torch.float32)
    same_dtype = reference if dtype == "float32" else hf_model(model_dir, DTYPES[dtype])
    for i, prompt in enumerate(batch):
        want, gaps, want_logits = hf_greedy(same_dtype, prompt)
        _, _, fp32_logits = hf_greedy(reference, prompt)
        if dtype == "float32":
            assert relative_error(first_logits[i], fp32_logits) < 1e-4
            same_or_diverged_at_a_near_tie(traces[i].tokens, want, gaps, FP32_TIE)
        else:
            hf_error = relative_error(want_logits, fp32_logits)
            srt_error = relative_error(first_logits[i], fp32_logits)
            assert srt_error <= BF16_ERROR_FACTOR * hf_error + BF16_ERROR_FLOOR, (srt_error, hf_error)
            same_or_diverged_at_a_near_tie(traces[i].tokens, want, gaps, BF16_TIE)


def test_a_replayed_decode_step_equals_the_eager_step(smollm2_shaped_model_dir):
    """Batch sizes that pad (3 -> 4, 5 -> 8), lengths that change between replays, and a smaller batch after
    a larger one (whose KV slots the padding rows must not touch)."""
    kw = dict(device="cuda", dtype="float32", max_total_tokens=8192, max_running_requests=16)
    graphed = ModelRunner(smollm2_shaped_model_dir, cuda_graph_max_bs=16, **kw)
    eager = ModelRunner(smollm2_shaped_model_dir, cuda_graph_max_bs=0, **kw)
    assert graphed.cuda_graph is not None and eager.cuda_graph is None
    for size, seed in ((5, 1), (3, 2), (1, 3)):
        batch = prompts(size, seed)
        got = PagedDriver(graphed).greedy(batch, NEW_TOKENS)
        want = PagedDriver(eager).greedy(batch, NEW_TOKENS)
        for g, w in zip(got, want, strict=True):
            same_or_diverged_at_a_near_tie(g.tokens, w.tokens, w.top2_gaps, FP32_TIE)


def test_kv_capacity_comes_from_free_gpu_memory(tiny_model_dir):
    """The free-memory branch: a fraction of free memory chosen to hold half the pool's context cap (a fixed
    1 % of an H200's free memory holds more than the tiny model's cap, so the cap alone was being tested)."""
    probe = ModelRunner(tiny_model_dir, device="cuda", max_total_tokens=1024, cuda_graph_max_bs=0)
    pool = probe.token_to_kv_pool
    per_token = pool.bytes_per_token(probe.kv_cache_dtype, pool.head_num, pool.head_dim, pool.layer_num)
    cap = MAX_CONTEXTS_IN_KV_POOL * probe.context_len
    del probe, pool
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    fraction = 0.5 * cap * per_token / free
    runner = ModelRunner(tiny_model_dir, device="cuda", mem_fraction_static=fraction, cuda_graph_max_bs=0)
    expected = fraction * free / per_token
    assert runner.max_total_num_tokens < cap
    assert abs(runner.max_total_num_tokens - expected) / expected < 0.05
    assert runner.dtype == torch.bfloat16 and runner.attention_backend_name in ("triton", "flashinfer")
