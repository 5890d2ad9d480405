"""W8A8 int8 linear layers for the CPU (`--quantization w8a8_int8`).

Why int8: a decode step streams every weight once, and this CPU's fp32 matmuls are memory-bound at small
batches; int8 weights are a quarter of the bytes, and `torch._int_mm` (int8 x int8 -> int32, oneDNN VNNI)
runs 4-7x faster than the fp32 matmul for this model's shapes at 1-128 rows, with the activation
quantization inside that figure (`scripts/bench_int8_gemm.py`).

The numerics: weights are quantized symmetrically per output channel, activations per token (absmax of the
row, round, clamp to +-127), both once per call with no loop over channels or blocks. Per-token scales alone
let a few outlier input channels (present in every Llama's hidden states) flatten every other channel to a
handful of levels, so each layer may carry a SmoothQuant vector `smooth` [K]: the activation is divided by
it and the weight's input channels multiplied by it before quantization — an identity in real numbers that
moves the outliers' range into the weight, where per-channel scales absorb it (`quantization.py`
calibrates it).

The accumulation is exact int32; the result is dequantized as acc * s_token * s_channel (+ bias), in fp32.
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
    its transposed view, measured fastest at one row), `scale` [N] fp32, `smooth` [K] fp32 or None."""

    weight: torch.Tensor
    scale: torch.Tensor
    smooth: torch.Tensor | None = None
    # 1 / smooth, kept so the per-call division is a multiplication
    inv_smooth: torch.Tensor | None = None

    @property
    def weight_t(self) -> torch.Tensor:
        return self.weight.t()


def quantize_per_channel(w: torch.Tensor, smooth: torch.Tensor | None = None) -> Int8Weight:
    """Symmetric per-output-channel int8 of an fp32 weight [N, K], after scaling its input channels by
    `smooth` (the activations are divided by the same vector at run time)."""
    w = w.float()
    if smooth is not None:
        w = w * smooth.float().unsqueeze(0)
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(MIN_SCALE)
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    inv = None if smooth is None else (1.0 / smooth.float()).contiguous()
    return Int8Weight(q.contiguous(), scale.contiguous(), smooth, inv)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, fp32 scales [M, 1]) of a 2-D activation: each row by its own absmax."""
    scale = (x.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp_min_(MIN_SCALE)
    return torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def w8a8_linear(x: torch.Tensor, qw: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` computed in int8: x [..., K] fp32 -> [..., N] fp32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if qw.inv_smooth is not None:
        x2 = x2 * qw.inv_smooth
    q, s = quantize_per_token(x2)
    out = torch._int_mm(q, qw.weight_t).to(torch.float32)
    out.mul_(s).mul_(qw.scale)
    if bias is not None:
        out.add_(bias)
    return out.view(*shape[:-1], out.shape[-1])


def smooth_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor s_j = max|X_j|^alpha / max|W_j|^(1-alpha), from calibrated
    activation absmax [K] and the weight [N, K]; channels never seen active keep 1."""
    w_max = weight.float().abs().amax(dim=0).clamp_min(MIN_SCALE)
    a_max = act_absmax.float().clamp_min(MIN_SCALE)
    s = a_max.pow(alpha) / w_max.pow(1.0 - alpha)
    s = torch.where(act_absmax > 0, s, torch.ones_like(s))
    return s.clamp(min=1e-4, max=1e4)
