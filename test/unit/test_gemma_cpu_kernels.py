"""Gemma's layers built with the int8 model's CPU kernels compute what their PyTorch forms compute: the
(1 + w) RMSNorm through the plain RMSNorm kernel, and the rotary embedding of q and k (normed or still views
of the fused projection) in place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.layers.rotary_embedding import RotaryEmbedding
from srt.model_executor.models.gemma import GemmaAttention, GemmaRMSNorm

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="srt's CPU kernels could not be built here")


def test_the_gemma_norm_runs_as_the_rmsnorm_kernel_with_one_plus_w():
    gen = torch.Generator().manual_seed(0)
    plain, fused = GemmaRMSNorm(64, 1e-6), GemmaRMSNorm(64, 1e-6, KERNELS)
    weight = torch.randn(64, generator=gen) * 0.3
    plain.weight.data.copy_(weight)
    fused.weight.data.copy_(weight)
    x = torch.randn(5, 4, 64, generator=gen) * 3
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 7])
def test_q_and_k_rotate_alike_through_the_kernel_whether_views_or_normed(n):
    """n = 1 makes q a contiguous view of the fused projection (rotated in place there), n = 7 a strided one
    (rotated in a copy); a normed q is a fresh tensor."""
    head_dim, heads = 16, 4
    config = SimpleNamespace(rope_theta=10_000.0)
    rope = RotaryEmbedding(config, head_dim, 64, torch.float32, "cpu")
    cos_sin = rope.tables(torch.arange(3, 3 + n))
    attn = GemmaAttention.__new__(GemmaAttention)
    torch.nn.Module.__init__(attn)
    attn.head_dim = head_dim
    gen = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, 3 * heads * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    want = rope.apply(q.clone(), *cos_sin)
    attn.rope_kernels = None
    torch.testing.assert_close(attn._rotate(q, rope, cos_sin), want)
    attn.rope_kernels = KERNELS
    torch.testing.assert_close(attn._rotate(q.clone(), rope, cos_sin), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(attn._rotate(q, rope, cos_sin), want, rtol=1e-6, atol=1e-6)
