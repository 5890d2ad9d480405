"""srt_lora_add, the CPU kernel behind an int8 model's adapter products (`CpuKernels.lora_add`): for every
sub-module of a fused layer, its shrink and expand added into its own columns, as the PyTorch segment
matmuls compute them (to float rounding), leaving every other column and row alone."""

from __future__ import annotations

import pytest
import torch

from srt.model_executor.layers import cpu_kernels

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="srt's CPU kernels do not load here")


@pytest.mark.parametrize("rows, k, rank, max_rank", [(1, 64, 8, 16), (5, 200, 16, 16), (3, 17, 3, 8)])
def test_lora_add_is_the_segment_matmuls(rows, k, rank, max_rank):
    gen = torch.Generator().manual_seed(rows * k)
    subs = [(0, 24), (24, 8), (40, 8)]  # a fused qkv's (offset, size); columns 32..39 belong to none
    x = torch.randn(rows, k, generator=gen)
    a = torch.randn(len(subs) * max_rank, k, generator=gen)
    b = torch.randn(max_rank, 48, generator=gen)  # B^T, as the pool keeps it
    out = torch.randn(rows + 1, 48, generator=gen)[:rows]  # a view: its row stride is its own
    want = out.clone()
    shrunk = x @ a[: len(subs) * rank].T
    for i, (offset, size) in enumerate(subs):
        want[:, offset : offset + size] += (
            shrunk[:, i * rank : (i + 1) * rank] @ b[:rank, offset : offset + size]
        )
    offsets = torch.tensor([o for o, _ in subs])
    sizes = torch.tensor([s for _, s in subs])
    KERNELS.lora_add(out, x, a[: len(subs) * rank].contiguous(), b, rank, offsets, sizes)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(out[:, 32:40], want[:, 32:40])  # no sub-module's columns: untouched


def test_lora_add_refuses_operands_it_cannot_read():
    x, a, b, out = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4, 6), torch.randn(2, 6)
    offsets, sizes = torch.tensor([0]), torch.tensor([6])
    with pytest.raises(TypeError):
        KERNELS.lora_add(out, x.double(), a, b, 4, offsets, sizes)
    with pytest.raises(ValueError):
        KERNELS.lora_add(out, x, a, b, 8, offsets, sizes)  # rank 8 needs 8 rows of A
