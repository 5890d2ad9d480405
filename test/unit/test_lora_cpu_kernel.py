"""srt_lora_add_segments, the CPU kernel behind an int8 model's adapter products
(`CpuKernels.lora_add_segments`): every adapter of a step in one call per layer, each of its rows getting, for
every sub-module of a fused layer, its shrink and expand added into that sub-module's own columns, as the
PyTorch matmuls compute them (to float rounding), leaving base rows and other columns alone; from a pool of
fp32 factors, or of fp16 ones widened exactly as they are read (the int8 model's pool)."""

from __future__ import annotations

import pytest
import torch

from srt.model_executor.layers import cpu_kernels

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="srt's CPU kernels do not load here")

SUBS = [(0, 24), (24, 8), (40, 8)]  # a fused qkv's (offset, size); columns 32..39 belong to none
WIDTH = 48
OFFSETS = torch.tensor([o for o, _ in SUBS])
SIZES = torch.tensor([s for _, s in SUBS])


def pool(slots: int, max_rank: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's pool: A [slots, sub-modules x max rank, k] and B^T [slots, max rank, width]."""
    a = torch.randn(slots, len(SUBS) * max_rank, k, generator=gen)
    return a, torch.randn(slots, max_rank, WIDTH, generator=gen)


def reference(out, x, row_slot: dict[int, tuple[int, int]], a, b) -> torch.Tensor:
    """Row by row with PyTorch matmuls: row -> (slot, rank)."""
    want = out.clone()
    for row, (slot, rank) in row_slot.items():
        shrunk = x[row] @ a[slot, : len(SUBS) * rank].T
        for i, (offset, size) in enumerate(SUBS):
            want[row, offset : offset + size] += (
                shrunk[i * rank : (i + 1) * rank] @ b[slot, :rank, offset : offset + size]
            )
    return want


@pytest.mark.parametrize("k, ranks", [(64, (8, 16)), (200, (16, 3)), (17, (1, 8))])
def test_one_call_adds_each_adapters_product_to_its_own_rows(k, ranks):
    """Rows of two adapters interleaved with base rows: gathered by `rows`, grouped in segments."""
    gen = torch.Generator().manual_seed(k)
    a, b = pool(3, 16, k, gen)
    x = torch.randn(7, k, generator=gen)
    out = torch.randn(8, WIDTH, generator=gen)[:7]  # a view: its row stride is its own
    row_slot = {0: (2, ranks[0]), 3: (2, ranks[0]), 5: (2, ranks[0]), 1: (0, ranks[1]), 6: (0, ranks[1])}
    rows = torch.tensor([0, 3, 5, 1, 6])
    table = torch.tensor([[2, ranks[0], 0, 3], [0, ranks[1], 3, 5]])
    want = reference(out, x, row_slot, a, b)
    KERNELS.lora_add_segments(out, x, rows, table, a, b, OFFSETS, SIZES)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    for base_row in (2, 4):
        assert torch.equal(out[base_row], want[base_row])  # no adapter: untouched
    assert torch.equal(out[:, 32:40], want[:, 32:40])  # no sub-module's columns: untouched


def test_every_row_adapted_and_grouped_needs_no_row_list():
    gen = torch.Generator().manual_seed(5)
    a, b = pool(2, 8, 64, gen)
    x, out = torch.randn(4, 64, generator=gen), torch.randn(4, WIDTH, generator=gen)
    want = reference(out, x, {0: (1, 8), 1: (1, 8), 2: (0, 4), 3: (0, 4)}, a, b)
    KERNELS.lora_add_segments(out, x, None, torch.tensor([[1, 8, 0, 2], [0, 4, 2, 4]]), a, b, OFFSETS, SIZES)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_a_gathered_row_gets_the_bits_of_an_expand_into_zeros_then_one_add(pool_dtype):
    """The module path's order of operations (gather, expand into zeros, index_add) and the kernel's agree to
    the bit, so the fused decode step and the modules give the same logits."""
    gen = torch.Generator().manual_seed(9)
    a, b = (t.to(pool_dtype) for t in pool(2, 16, 96, gen))
    x, out = torch.randn(3, 96, generator=gen), torch.randn(3, WIDTH, generator=gen)
    rows, table = torch.tensor([2, 0]), torch.tensor([[1, 16, 0, 2]])
    delta = torch.zeros(2, WIDTH)
    KERNELS.lora_add_segments(delta, x[rows].contiguous(), None, table, a, b, OFFSETS, SIZES)
    want = out.clone().index_add_(0, rows, delta)
    KERNELS.lora_add_segments(out, x, rows, table, a, b, OFFSETS, SIZES)
    assert torch.equal(out, want)


@pytest.mark.parametrize("k", [64, 200, 17])
def test_an_fp16_pool_gives_the_products_of_its_factors_widened_to_fp32(k):
    """Every SIMD form widens a half exactly (F16C or bit by bit), then multiplies and sums in fp32."""
    gen = torch.Generator().manual_seed(k + 1)
    a, b = (t.half() for t in pool(3, 16, k, gen))
    x = torch.randn(7, k, generator=gen)
    out = torch.randn(7, WIDTH, generator=gen)
    row_slot = {0: (2, 16), 3: (2, 16), 5: (2, 16), 1: (0, 8), 6: (0, 8)}
    rows, table = torch.tensor([0, 3, 5, 1, 6]), torch.tensor([[2, 16, 0, 3], [0, 8, 3, 5]])
    want = reference(out, x, row_slot, a.float(), b.float())
    KERNELS.lora_add_segments(out, x, rows, table, a, b, OFFSETS, SIZES)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    for base_row in (2, 4):
        assert torch.equal(out[base_row], want[base_row])
    assert torch.equal(out[:, 32:40], want[:, 32:40])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_a_large_step_gives_each_row_the_bits_it_gets_in_a_small_one(pool_dtype):
    """A step whose shrunk rows fit one buffer (decode) runs its segments together; a larger one (a prefill)
    runs them one after another: a row's products must not depend on which."""
    gen = torch.Generator().manual_seed(13)
    a, b = (t.to(pool_dtype) for t in pool(3, 16, 64, gen))
    rows = 180  # 2 segments x 90 rows x 3 sub-modules x rank 16: past the kernel's one-buffer size
    x = torch.randn(rows, 64, generator=gen)
    start = torch.randn(rows, WIDTH, generator=gen)
    order = torch.randperm(rows, generator=gen)
    table = torch.tensor([[2, 16, 0, 90], [0, 16, 90, 180]])
    whole = start.clone()
    KERNELS.lora_add_segments(whole, x, order, table, a, b, OFFSETS, SIZES)
    by_row = start.clone()
    for pos in range(rows):
        seg = 0 if pos < 90 else 1
        one = torch.tensor([[int(table[seg, 0]), 16, 0, 1]])
        KERNELS.lora_add_segments(by_row, x, order[pos : pos + 1].contiguous(), one, a, b, OFFSETS, SIZES)
    assert torch.equal(whole, by_row)


def test_operands_it_cannot_read_are_refused():
    a, b = pool(2, 4, 8, torch.Generator().manual_seed(1))
    x, out = torch.randn(2, 8), torch.randn(2, WIDTH)
    table = torch.tensor([[0, 4, 0, 2]])
    with pytest.raises(TypeError):
        KERNELS.lora_add_segments(out, x.double(), None, table, a, b, OFFSETS, SIZES)
    for pool_a, pool_b in ((a.half(), b), (a.bfloat16(), b.bfloat16())):  # mixed formats, or bf16
        with pytest.raises(TypeError):
            KERNELS.lora_add_segments(out, x, None, table, pool_a, pool_b, OFFSETS, SIZES)
    for bad in ([[2, 4, 0, 2]], [[0, 8, 0, 2]], [[0, 4, 0, 3]], [[0, 4, 1, 0]]):  # slot, rank, end, start
        with pytest.raises(ValueError):
            KERNELS.lora_add_segments(out, x, None, torch.tensor(bad), a, b, OFFSETS, SIZES)
    with pytest.raises(ValueError):  # a row past x
        KERNELS.lora_add_segments(out, x, torch.tensor([0, 2]), table, a, b, OFFSETS, SIZES)
