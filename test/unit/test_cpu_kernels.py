"""srt's fused CPU int8 kernels (`cpu_*_kernels.c`): they build with the system compiler, reproduce the
PyTorch int8 path to the bit in every instruction-set variant, give a token the same result alone or in a
batch, and their absence (no compiler) only means PyTorch ops."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from srt.model_executor.layers import cpu_kernel_build, cpu_kernels
from srt.model_executor.layers.int8_linear import pack_weight, w8a8_linear
from srt.model_executor.layers.int8_math import (
    int8_products,
    quantize_per_channel,
    quantize_two_level,
    torch_w8a8_linear,
)

HAS_COMPILER = shutil.which("cc") is not None
CPU_FLAGS = open("/proc/cpuinfo").read() if HAS_COMPILER else ""
# (name, -march): every variant this CPU can run; the native build is the one srt uses
VARIANTS = [("native", "native")]
if " avx2 " in CPU_FLAGS:
    VARIANTS.append(("avx2", "haswell"))
VARIANTS.append(("portable", "x86-64"))

pytestmark = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def variant_cache(tmp_path_factory) -> str:
    """One cache for every variant's library (its name includes the flags, so variants never collide)."""
    return str(tmp_path_factory.mktemp("variants"))


def build_variant(cache: str, march: str) -> cpu_kernels.CpuKernels:
    mp = pytest.MonkeyPatch()
    mp.setenv("SRT_CACHE_DIR", cache)
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in cpu_kernel_build.FLAGS)
    built = cpu_kernels.CpuKernels(cpu_kernel_build.build(flags=flags))
    mp.undo()
    return built


@pytest.fixture(scope="module", params=VARIANTS, ids=[name for name, _ in VARIANTS])
def kernels(request, variant_cache) -> cpu_kernels.CpuKernels:
    return build_variant(variant_cache, request.param[1])


def test_the_native_build_is_the_fast_one_here(kernels):
    native = cpu_kernels.load()
    assert native is not None, "the kernels must build and pass their probe on this machine"
    if " avx512_vnni " in CPU_FLAGS:
        assert native.isa == "avx512-vnni"
    elif " avx2 " in CPU_FLAGS:
        assert native.isa == "avx2"


def test_each_variant_passes_the_load_probe(kernels):
    assert cpu_kernels.agrees_with_torch(kernels)


def strided_rows(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows with an outlier channel, as a view into a wider tensor (a fused projection's slice)."""
    wide = torch.randn(m, k + 32, generator=gen)
    wide[:, 5] *= 60.0
    return wide[:, 16 : 16 + k]


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 33, 70])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_fused_linear_gives_the_bits_of_the_pytorch_path(kernels, m, with_bias):
    """Up to 8 tokens on the kernel's stack, more with scratch and in blocks of 32 tokens (33 and 70 end
    in a partial block)."""
    gen = torch.Generator().manual_seed(m)
    k, n = 3 * kernels.k_multiple if kernels.k_multiple > 1 else 40, 74  # 74: the last weight tile is partial
    qw = quantize_per_channel(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = strided_rows(m, k, gen)
    assert torch.equal(kernels.linear(x, qw.weight, qw.scale, bias), torch_w8a8_linear(x, qw, bias))


@pytest.mark.parametrize("m", [1, 5, 9])
@pytest.mark.parametrize("k_steps", [129, 513])
def test_the_fused_linear_is_exact_for_rows_longer_than_one_int32_sum(kernels, m, k_steps):
    """AVX2 sums at most 2048 int16 products in int32 and adds longer rows' chunks in int64; beyond 8192
    features the quantized rows no longer fit the kernel's stack. Activations and weights near the top of
    their ranges (7875 and 127) make the longer rows' dot products overflow int32."""
    k = k_steps * max(kernels.k_multiple, 16)
    qw = quantize_per_channel(torch.full((6, k), 0.5))
    qw.weight[1, : k // 2] = -127
    x = torch.ones(m, k)
    x[:, -1] = 1.0 + 1.0 / 126.0  # the row's absmax: every other feature is 63 levels less a residual
    expected = torch_w8a8_linear(x, qw, None)
    assert expected.abs().max() > 0
    assert torch.equal(kernels.linear(x, qw.weight, qw.scale, None), expected)


@pytest.mark.parametrize("m", [1, 8, 9, 128, 129, 300])
def test_the_fused_linear_takes_what_oneDNN_cannot_and_the_token_counts_it_wins_with_VNNI(kernels, m):
    k = 4 * kernels.k_multiple
    vnni = kernels.isa == "avx512-vnni"
    # without VNNI oneDNN's int8 is not exact: every call; with it, a library kernel is exact and the fused
    # kernel takes up to the measured crossover, lower beside oneDNN's packed kernel than beside _int_mm
    beside_int_mm = m <= cpu_kernels.FUSED_TOKENS_BESIDE_INT_MM
    beside_packed = m <= cpu_kernels.FUSED_TOKENS_BESIDE_PACKED
    assert kernels.takes_linear(m, k, has_packed=False) == (beside_int_mm if vnni else True)
    assert kernels.takes_linear(m, k, has_packed=True) == (vnni and beside_packed)
    if kernels.k_multiple > 1:
        assert not kernels.takes_linear(m, k + 1, has_packed=False)  # a width its vector steps cannot split


def test_quantize_and_combine_give_the_pytorch_bits_at_prefill_sizes(kernels):
    """300 rows of 576: large enough for the kernels' parallel loops."""
    gen = torch.Generator().manual_seed(11)
    x = strided_rows(300, 576, gen)
    q, s = kernels.quantize_two_level(x)
    q_ref, s_ref = quantize_two_level(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    qw = quantize_per_channel(torch.randn(256, 576, generator=gen))
    bias = torch.randn(256, generator=gen)
    combined = kernels.combine_two_level(int8_products(q, qw), s, qw.scale, bias)
    assert torch.equal(combined, torch_w8a8_linear(x, qw, bias))


def test_storing_kv_rounds_to_fp16_as_pytorch_does(kernels):
    """The lean decode step writes K/V into the pool itself: to fp16 with ties to even, subnormals, overflow
    to infinity and signed zeros as `.to(torch.float16)`. 13 values per head row, so the vector and the
    scalar paths both run."""
    ties = [1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 65519.0, 65520.0, -0.0, 2**-14 - 2**-26]
    gen = torch.Generator().manual_seed(12)
    qkv = torch.randn(5, 26, generator=gen) * torch.logspace(-9, 5, 26)
    qkv[0, : len(ties)] = torch.tensor(ties)
    qkv[1, 3], qkv[2, 20] = float("inf"), -float("inf")
    loc = torch.tensor([3, 0, 7, 1, 5])
    for dtype, bits in ((torch.float16, torch.int16), (torch.float32, torch.int32)):
        k_pool, v_pool = torch.zeros(8, 13, dtype=dtype), torch.zeros(8, 13, dtype=dtype)
        half = int(dtype == torch.float16)
        kernels.function("srt_store_kv")(
            qkv.data_ptr(), 5, 26, 0, 13, 13, loc.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), half
        )
        expected_k, expected_v = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
        expected_k[loc], expected_v[loc] = qkv[:, :13].to(dtype), qkv[:, 13:].to(dtype)
        assert torch.equal(k_pool.view(bits), expected_k.view(bits))
        assert torch.equal(v_pool.view(bits), expected_v.view(bits))


def test_all_zero_and_huge_rows_quantize_like_pytorch(kernels):
    x = torch.zeros(3, 64)
    x[1] = 3e30
    x[2, 7] = -1e-30
    q, s = kernels.quantize_two_level(x)
    q_ref, s_ref = quantize_two_level(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_a_token_gets_the_same_bits_alone_and_in_any_batch():
    """w8a8_linear takes the fused kernel for a few tokens and oneDNN's for more (or the fused one for all,
    in blocks, where oneDNN is not exact): a sequence's output must not depend on which (the
    scheduler-equivalence tests rely on it)."""
    if cpu_kernels.load() is None:
        pytest.skip("the kernels did not load")
    gen = torch.Generator().manual_seed(3)
    qw = quantize_per_channel(torch.randn(192, 128, generator=gen))
    pack_weight(qw)
    x = strided_rows(70, 128, gen)
    alone = w8a8_linear(x[:1], qw, None)
    for batch in (2, 8, 9, 40, 70):
        assert torch.equal(w8a8_linear(x[:batch], qw, None)[:1], alone)


def test_rmsnorm_and_silu_mul_agree_with_pytorch_and_are_row_independent(kernels):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 3, 96, generator=gen) * 3.0
    w = torch.randn(96, generator=gen)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = kernels.rmsnorm(x, w, 1e-6)
    assert got.shape == x.shape and torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(kernels.rmsnorm(x[4:5], w, 1e-6), got[4:5])
    gate_up = torch.randn(300, 2 * 200, generator=gen) * 6.0
    ref = F.silu(gate_up[:, :200]) * gate_up[:, 200:]
    got = kernels.silu_mul(gate_up, 200)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(kernels.silu_mul(gate_up[7:8], 200), got[7:8])


@pytest.fixture(scope="module")
def portable(variant_cache) -> cpu_kernels.CpuKernels:
    """The portable variant's library (built once with the variants')."""
    return build_variant(variant_cache, "x86-64")


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_the_lane_reductions_give_the_portable_loops_bits_in_every_variant(kernels, portable, pool_dtype):
    """RMSNorm's sum of squares and the LoRA shrink keep 16 partial sums, whether the compiler vectorizes
    the loop or the kernel spells out the SIMD (an fp16 pool's factors widened by F16C or bit by bit): a
    variant that summed in another order would give the fused decode step other bits than the module path
    on another machine."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 1545, generator=gen) * 2.0  # not a multiple of 16: the tail too
    w = torch.randn(1545, generator=gen)
    assert torch.equal(kernels.rmsnorm(x, w, 1e-6), portable.rmsnorm(x, w, 1e-6))
    a = (torch.randn(2, 2 * 8, 1545, generator=gen) * 0.1).to(pool_dtype)
    b = (torch.randn(2, 8, 40, generator=gen) * 0.1).to(pool_dtype)
    table = torch.tensor([[1, 8, 0, 2], [0, 8, 2, 5]], dtype=torch.int64)
    offsets, sizes = torch.tensor([0, 24], dtype=torch.int64), torch.tensor([24, 16], dtype=torch.int64)
    outs = []
    for built in (kernels, portable):
        out = torch.ones(5, 40)
        built.lora_add_segments(out, x, None, table, a, b, offsets, sizes)
        outs.append(out)
    assert not torch.equal(outs[0], torch.ones(5, 40))
    assert torch.equal(outs[0], outs[1])


def test_the_kernels_refuse_tensors_they_cannot_read(kernels):
    with pytest.raises(TypeError, match="fp32 CPU"):
        kernels.rmsnorm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)


def test_without_a_compiler_srt_falls_back_to_pytorch_ops(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert cpu_kernels.load() is None
        assert "unavailable" in caplog.text
        gen = torch.Generator().manual_seed(1)
        qw = quantize_per_channel(torch.randn(24, 64, generator=gen))
        x = torch.randn(2, 64, generator=gen)
        assert torch.equal(w8a8_linear(x, qw, None), torch_w8a8_linear(x, qw, None))
    finally:
        cpu_kernels.load.cache_clear()  # the next caller builds (or finds) the real library again


def test_rope_rotates_q_and_k_in_place_to_the_bits_of_the_model_code(kernels):
    from types import SimpleNamespace

    from srt.model_executor.layers.rotary_embedding import RotaryEmbedding

    heads, kv_heads, head_dim, n = 4, 2, 16, 9
    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), head_dim, 64, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen)
    cos, sin = rope.tables(torch.randint(0, 64, (n,), generator=gen))
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    expected_q, expected_k, v = (
        rope.apply(q, cos, sin),
        rope.apply(k, cos, sin),
        qkv[:, -kv_heads * head_dim :],
    )
    v_before = v.clone()
    kernels.rope_(qkv, heads + kv_heads, head_dim, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, v_before)  # v is not rotated
    with pytest.raises(TypeError):
        kernels.rope_(qkv[:, :8], heads + kv_heads, head_dim, cos, sin)  # too narrow for the heads


def test_decode_attention_reads_the_pool_in_place_and_matches_sdpa(kernels):
    """Sequences of different lengths scattered over a pool: the result equals SDPA over each sequence's
    gathered K/V (to float precision), and a sequence's bits do not depend on the rest of the batch."""
    heads, kv_heads, head_dim, pool_slots = 6, 2, 32, 200
    gen = torch.Generator().manual_seed(12)
    k_pool = torch.randn(pool_slots, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(pool_slots, kv_heads, head_dim, generator=gen)
    lens = [5, 37, 1, 20]
    slots = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for b, n in enumerate(lens):
        slots[b, :n] = torch.randperm(pool_slots - 1, generator=gen)[:n] + 1
    q = torch.randn(len(lens), heads, head_dim, generator=gen) * 2.0
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    out = kernels.decode_attention(q, k_pool, v_pool, slots, seq_lens, head_dim**-0.5)
    assert out.shape == (len(lens), heads * head_dim)
    for b, n in enumerate(lens):
        keys, values = k_pool[slots[b, :n]].transpose(0, 1), v_pool[slots[b, :n]].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[b].unsqueeze(1), keys, values, enable_gqa=True)
        assert torch.allclose(out[b].view(heads, head_dim), ref.squeeze(1), rtol=1e-5, atol=1e-5), b
        alone = kernels.decode_attention(q[b : b + 1], k_pool, v_pool, slots[b : b + 1, :n].contiguous(),
                                         seq_lens[b : b + 1], head_dim**-0.5)  # fmt: skip
        assert torch.equal(alone, out[b : b + 1])
    with pytest.raises(TypeError):
        kernels.decode_attention(q, k_pool, v_pool, slots, seq_lens.int(), 1.0)
    with pytest.raises(ValueError, match="heads"):
        kernels.decode_attention(q[:, :5], k_pool, v_pool, slots, seq_lens, 1.0)


@pytest.mark.parametrize("head_dim", [32, 20])  # 20: the kernels' vector blocks and their scalar tail
def test_extend_attention_is_causal_sdpa_and_gives_each_token_its_decode_bits(kernels, head_dim):
    """A 23-token sequence scattered over the pool: extending it all at once equals causal SDPA (to float
    precision); extending it in chunks after a prefix, and decoding each token alone at its position, give
    every token the same bits: the property that makes chunking, prefix hits and retraction invisible."""
    heads, kv_heads, pool_slots, n = 6, 2, 100, 23
    gen = torch.Generator().manual_seed(13)
    k_pool = torch.randn(pool_slots, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(pool_slots, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(pool_slots - 1, generator=gen)[:n] + 1
    q = torch.randn(n, heads, head_dim, generator=gen) * 2.0
    scale = head_dim**-0.5
    whole = torch.empty(n, heads, head_dim)
    kernels.extend_attention(q, k_pool, v_pool, slots, 0, scale, whole)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1),
        is_causal=True, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    assert torch.allclose(whole, ref, rtol=1e-5, atol=1e-5)
    for prefix in (1, 9, n - 1):
        tail = torch.empty(n - prefix, heads, head_dim)
        kernels.extend_attention(q[prefix:], k_pool, v_pool, slots, prefix, scale, tail)
        assert torch.equal(tail, whole[prefix:]), prefix
    for i in range(n):
        one = kernels.decode_attention(q[i : i + 1], k_pool, v_pool, slots[None, : i + 1].contiguous(),
                                       torch.tensor([i + 1]), scale)  # fmt: skip
        assert torch.equal(one.view(heads, head_dim), whole[i]), i
    # a strided q (a view into a fused qkv row) reads the same
    qkv = torch.cat([q.reshape(n, -1), torch.randn(n, 2 * kv_heads * head_dim, generator=gen)], dim=1)
    strided = torch.empty(n, heads, head_dim)
    kernels.extend_attention(qkv[:, : heads * head_dim].view(n, heads, head_dim), k_pool, v_pool, slots, 0,
                             scale, strided)  # fmt: skip
    assert torch.equal(strided, whole)
    with pytest.raises(ValueError, match="slots"):
        kernels.extend_attention(q, k_pool, v_pool, slots[:-1], 0, scale, whole)
    with pytest.raises(TypeError):
        kernels.extend_attention(q, k_pool, v_pool, slots.int(), 0, scale, whole)


@pytest.mark.parametrize("head_dim", [64, 20])
def test_a_half_precision_pool_attends_exactly_as_its_values_in_fp32(kernels, head_dim):
    """`--kv-cache-dtype float16`: the kernels widen fp16 K/V exactly, so attending over an fp16 pool gives
    the bits of attending over the same values stored as fp32, in decode and extend alike (subnormal and
    huge values included)."""
    heads, kv_heads, pool_slots, n = 6, 2, 60, 19
    gen = torch.Generator().manual_seed(14)
    k16 = (torch.randn(pool_slots, kv_heads, head_dim, generator=gen) * 3.0).half()
    v16 = (torch.randn(pool_slots, kv_heads, head_dim, generator=gen) * 3.0).half()
    k16[5, 0, :4] = torch.tensor([6e-8, -3e-5, 60000.0, 0.0]).half()  # subnormals, near the fp16 maximum
    v16[7, 1, :3] = torch.tensor([1e-7, -6e-5, -50000.0]).half()
    k32, v32 = k16.float(), v16.float()
    slots = torch.randperm(pool_slots - 1, generator=gen)[:n] + 1
    slots[0], slots[1] = 5, 7
    q = torch.randn(n, heads, head_dim, generator=gen) * 0.01
    for pools in ((k16, v16), (k32, v32)):
        out = torch.empty(n, heads, head_dim)
        kernels.extend_attention(q, *pools, slots, 0, head_dim**-0.5, out)
        if pools[0].dtype == torch.float16:
            half_out = out
    assert torch.equal(half_out, out)
    lens = torch.tensor([n, 3, 11])
    table = slots[None, :].expand(3, n).contiguous()
    decoded = [
        kernels.decode_attention(q[:3], k, v, table, lens, head_dim**-0.5)
        for k, v in ((k16, v16), (k32, v32))
    ]
    assert torch.equal(decoded[0], decoded[1])
    with pytest.raises(TypeError):
        kernels.decode_attention(q[:3], k16, v32, table, lens, 1.0)  # mixed pool dtypes


@pytest.mark.parametrize("head_dim", [32, 20])
def test_windowed_and_capped_attention_keeps_each_tokens_decode_bits(kernels, head_dim):
    """With a sliding window of W keys (the token at position p sees p - W < j <= p) and a logit soft-cap
    (scores s -> cap * tanh(s / cap)), extend equals a float64 reference, and the whole prompt, its chunks
    after a prefix, and decoding each token alone at its position give every token the same bits (windows
    start inside the kernel's 16-token blocks and its 8-key tiles). A window no sequence outgrows is full
    attention to the bit."""
    heads, kv_heads, pool_slots, n = 6, 2, 100, 41
    gen = torch.Generator().manual_seed(15)
    k_pool = torch.randn(pool_slots, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(pool_slots, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(pool_slots - 1, generator=gen)[:n] + 1
    q = torch.randn(n, heads, head_dim, generator=gen) * 3.0
    scale, group = head_dim**-0.5, heads // kv_heads
    keys = k_pool[slots].double().repeat_interleave(group, 1)
    values = v_pool[slots].double().repeat_interleave(group, 1)
    for window, cap in ((1, None), (5, None), (11, 4.0), (None, 4.0), (n, None)):
        whole = torch.empty(n, heads, head_dim)
        kernels.extend_attention(q, k_pool, v_pool, slots, 0, scale, whole, window, cap)
        scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        position, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
        visible = (key <= position) & (key > position - (window or n))
        ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
        assert torch.allclose(whole.double(), ref, rtol=1e-4, atol=3e-5), (window, cap)
        for prefix in (3, 17, n - 1):
            tail = torch.empty(n - prefix, heads, head_dim)
            kernels.extend_attention(q[prefix:], k_pool, v_pool, slots, prefix, scale, tail, window, cap)
            assert torch.equal(tail, whole[prefix:]), (window, cap, prefix)
        table = slots[None, :].expand(n, n).contiguous()  # decode every position at once, one per row
        decoded = kernels.decode_attention(
            q, k_pool, v_pool, table, torch.arange(1, n + 1), scale, window, cap
        )
        assert torch.equal(decoded.view(n, heads, head_dim), whole), (window, cap)
    full = torch.empty(n, heads, head_dim)
    kernels.extend_attention(q, k_pool, v_pool, slots, 0, scale, full)
    assert torch.equal(whole, full)  # the last window above (n keys) hides nothing
    with pytest.raises(ValueError, match="window"):
        kernels.extend_attention(q, k_pool, v_pool, slots, 0, scale, whole, 0)
    for cap in (-1.0, float("inf"), float("nan")):  # the Triton kernels' rule too (attention/window_cap.py)
        with pytest.raises(ValueError, match="cap"):
            kernels.decode_attention(q, k_pool, v_pool, table, torch.arange(1, n + 1), scale, None, cap)


@pytest.mark.parametrize("n", [1, 7, 8, 31, 32, 33, 95, 1000])
def test_argmax_rows_answers_as_torch_max_on_ties_infinities_and_nans(kernels, n):
    """The sampler's greedy choice: the first maximal index, a NaN above everything (the first NaN), in
    every lane position of the vector compare chains and in the tail after them."""
    gen = torch.Generator().manual_seed(n)
    wide = torch.randint(-2, 3, (64, n + 3), generator=gen).float()  # few values: many ties
    wide[8:16] = float("-inf")
    wide[16:24, ::3] = float("inf")
    wide[24:40][torch.rand(16, n + 3, generator=gen) < 0.1] = float("nan")
    wide[40:48] = torch.randn(8, n + 3, generator=gen)
    wide[48:56] = -0.0
    wide[48:56, ::2] = 0.0
    x = wide[:, 1 : 1 + n]  # a strided view, as the logits' unpadded vocabulary is
    assert torch.equal(kernels.argmax_rows(x), x.max(dim=-1).indices)
    for row in range(0, 64, 7):  # each row alone, as a decode step's one row
        assert torch.equal(kernels.argmax_rows(x[row : row + 1]), x[row : row + 1].max(dim=-1).indices)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gathered", [False, True])
def test_the_lora_expand_gives_the_portable_loops_bits_over_whole_and_partial_column_blocks(
    kernels, portable, gathered, pool_dtype
):
    """The expand goes by blocks of 128 output columns: over whole blocks and a partial one, every variant
    gives the portable loop's bits, for rows added in place and for gathered rows (summed from zero, then
    added once); an expand that fused the multiply-add would not."""
    gen = torch.Generator().manual_seed(12)
    k, rank = 96, 16
    sizes = torch.tensor([256, 136], dtype=torch.int64)  # two whole blocks; one whole and a part of 8
    offsets = torch.tensor([0, 256], dtype=torch.int64)
    x = torch.randn(6, k, generator=gen)
    a = (torch.randn(2, 2 * rank, k, generator=gen) * 0.1).to(pool_dtype)
    b = (torch.randn(2, rank, 392, generator=gen) * 0.1).to(pool_dtype)
    rows = torch.tensor([4, 1, 5, 0], dtype=torch.int64) if gathered else None
    table = torch.tensor([[1, rank, 0, 2], [0, 12, 2, 4]], dtype=torch.int64)
    outs = []
    for built in (kernels, portable):
        out = torch.randn(6, 392, generator=torch.Generator().manual_seed(3))
        built.lora_add_segments(out, x, rows, table, a, b, offsets, sizes)
        outs.append(out)
    untouched = torch.randn(6, 392, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(outs[0], untouched)
    assert torch.equal(outs[0], outs[1])


def test_the_launcher_starts_the_build_and_the_scheduler_finds_it(monkeypatch, tmp_path):
    """`build_in_background` (the launcher's, before its children start) compiles while the scheduler starts:
    the scheduler's own build() waits on the lock and finds that library, compiled once. No thread for a GPU
    device (or `auto` where an NVIDIA driver is loaded); a failed compile is left to the scheduler's build(),
    which raises it."""
    monkeypatch.setenv("SRT_CACHE_DIR", str(tmp_path))
    compiled, started = [], threading.Event()

    def slow_link(cc, flags, objects, path):
        started.set()
        time.sleep(0.5)
        compiled.append(path)
        with open(path, "wb") as f:
            f.write(b"library")

    monkeypatch.setattr(cpu_kernel_build, "_compile", lambda cc, objects: None)
    monkeypatch.setattr(cpu_kernel_build, "_link", slow_link)
    thread = cpu_kernel_build.build_in_background("cpu")
    assert thread is not None and started.wait(10)
    path = cpu_kernel_build.build()  # the scheduler's call, while the launcher's compile runs
    assert compiled == [path] and os.path.isfile(path)
    thread.join(10)

    assert cpu_kernel_build.build_in_background("cuda") is None
    monkeypatch.setattr(cpu_kernel_build, "NVIDIA_CONTROL_DEVICE", str(tmp_path))  # exists: a driver
    assert cpu_kernel_build.build_in_background("auto") is None

    monkeypatch.setenv("SRT_CACHE_DIR", str(tmp_path / "second"))

    def failing_compile(cc, objects):
        raise subprocess.CalledProcessError(1, [cc], stderr="error: no such instruction")

    monkeypatch.setattr(cpu_kernel_build, "_compile", failing_compile)
    thread = cpu_kernel_build.build_in_background("cpu")
    thread.join(10)
    assert not thread.is_alive()  # it ended quietly ...
    with pytest.raises(subprocess.CalledProcessError):
        cpu_kernel_build.build()  # ... and the scheduler's build reports the error
