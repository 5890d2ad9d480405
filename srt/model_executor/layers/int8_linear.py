"""W8A8 int8 linear layers for the CPU (`--quantization w8a8_int8`).

Why int8: a decode step streams every weight once, and this CPU's fp32 matmuls are memory-bound at small
batches; int8 weights are a quarter of the bytes, and `torch._int_mm` (int8 x int8 -> int32, oneDNN VNNI)
runs 4-7x faster than the fp32 matmul for this model's shapes at 1-128 rows, with the activation
quantization inside that figure (`scripts/bench_int8_gemm.py`).

The numerics: weights are quantized symmetrically per output channel (once, at load: `quantization.py`,
with GPTQ's error-compensating rounding from `gptq.py`), activations per token at every call (absmax of the
row, round, clamp to +-127), with no loop over channels or blocks.

Per-token int8 alone leaves every activation with a rounding error of up to absmax/254, and a few outlier
input channels (present in every Llama's hidden states) set that absmax: +1.5-1.8 % perplexity on this model,
which SmoothQuant-style smoothing only brought to +1.5 %. So each activation row is quantized in two levels:
its int8 image, then the int8 image of what that left (the residual, 127x smaller). Both go through one
`_int_mm` call as 2M rows: at decode sizes the call is bound by reading the weight, so the second level is
nearly free, and the activation is then exact to about 1/32,000 of its absmax. What remains is the weights'
rounding (`scripts/eval_quality.py` measures the whole).

The accumulation is exact int32; the result is dequantized as (acc1 * s1 + acc2 * s2) * s_channel (+ bias),
in fp32. Every row is quantized on its own, so a sequence's result does not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127.0
# Smallest scale: an all-zero row or channel must not divide by zero (its values quantize to 0 anyway).
MIN_SCALE = 1e-8


@dataclass
class Int8Weight:
    """One layer's quantized weight. `weight` is [N, K] int8 (row-major, as nn.Linear's; `_int_mm` takes
    its transposed view, measured fastest at one row), `scale` [N] fp32: weight ~= int8 * scale[:, None]."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def weight_t(self) -> torch.Tensor:
        return self.weight.t()


def quantize_per_channel(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of an fp32 weight [N, K], each weight rounded to its nearest level."""
    w = w.float()
    scale = channel_scales(w)
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    """[N] fp32: each output channel's absmax over 127."""
    return (w.abs().amax(dim=1) / INT8_MAX).clamp_min(MIN_SCALE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, fp32 scales [M, 1]) of a 2-D activation: each row by its own absmax."""
    scale = (x.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min_(MIN_SCALE)
    return torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_two_level(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [2M, K], fp32 scales [2M, 1]) of a 2-D activation [M, K]: rows 0..M-1 are its per-token int8
    image, rows M..2M-1 the per-token int8 image of the residual x - image."""
    m = x.shape[0]
    q = torch.empty((2 * m, x.shape[1]), dtype=torch.int8, device=x.device)
    scale = torch.empty((2 * m, 1), dtype=torch.float32, device=x.device)
    torch.div(x.abs().amax(dim=1, keepdim=True), INT8_MAX, out=scale[:m]).clamp_min_(MIN_SCALE)
    level1 = torch.round(x / scale[:m]).clamp_(-INT8_MAX, INT8_MAX)
    q[:m].copy_(level1)
    residual = level1.mul_(scale[:m]).neg_().add_(x)
    torch.div(residual.abs().amax(dim=1, keepdim=True), INT8_MAX, out=scale[m:]).clamp_min_(MIN_SCALE)
    q[m:].copy_(residual.div_(scale[m:]).round_().clamp_(-INT8_MAX, INT8_MAX))
    return q, scale


def w8a8_linear(x: torch.Tensor, qw: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` computed in int8: x [..., K] fp32 -> [..., N] fp32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    q, s = quantize_two_level(x2)
    acc = torch._int_mm(q, qw.weight_t).to(torch.float32).mul_(s)
    out = acc[:m].add_(acc[m:]).mul_(qw.scale)
    if bias is not None:
        out.add_(bias)
    return out.view(*shape[:-1], out.shape[-1])
