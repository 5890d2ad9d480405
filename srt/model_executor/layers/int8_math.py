"""The int8 arithmetic of `--quantization w8a8_int8` in PyTorch ops: per-channel weight quantization, the
two-level activation quantization, exact integer products and the one dequantization (the numerics are
explained in `int8_linear.py`). This is the reference srt's C kernels must reproduce to the bit
(`cpu_kernels.agrees_with_torch`), and the path used where they cannot be built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127.0  # weights
ACTIVATION_MAX = 63.0  # each activation level (see above)
# Smallest scale: an all-zero row or channel must not divide by zero (its values quantize to 0 anyway).
MIN_SCALE = 1e-8


@dataclass
class Int8Weight:
    """One layer's quantized weight. `weight` is [N, K] int8 (row-major, as nn.Linear's; `_int_mm` takes
    its transposed view, measured fastest at one row), `scale` [N] fp32: weight ~= int8 * scale[:, None].
    `packed` is oneDNN's packed form of `weight` (see `pack`)."""

    weight: torch.Tensor | None
    scale: torch.Tensor
    packed: torch.Tensor | None = None
    zero_points: torch.Tensor | None = None  # [N] int64 zeros: oneDNN's kernel takes them
    unit_scale: torch.Tensor | None = None  # [N] ones: oneDNN's kernel then gives the integer products

    @property
    def weight_t(self) -> torch.Tensor:
        return self.weight.t()

    def pack_unchecked(self, keep_plain: bool = False) -> None:
        self.packed = torch.ops.onednn.qlinear_prepack(self.weight, None)
        self.zero_points = torch.zeros(self.weight.shape[0], dtype=torch.int64)
        self.unit_scale = torch.ones(self.weight.shape[0], dtype=torch.float32)
        if not keep_plain:
            self.weight = None


def quantize_per_channel(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of an fp32 weight [N, K], each weight rounded to its nearest level."""
    w = w.float()
    scale = channel_scales(w)
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    """[N] fp32: each output channel's absmax over 127."""
    return (w.abs().amax(dim=1) / INT8_MAX).clamp_min(MIN_SCALE)


# The residual of rounding lies within half a level: in units of the first level it is in [-0.5, 0.5], so
# this factor maps it onto [-63, 63] with no absmax of its own to compute.
RESIDUAL_LEVELS = 2 * ACTIVATION_MAX


def quantize_two_level(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [2M, K], fp32 scales [2M, 1]) of a 2-D activation [M, K]: rows 0..M-1 are its per-token 7-bit
    image (scale s = absmax / 63), rows M..2M-1 the 7-bit image of the residual, at scale s / 126.
    Few ops on purpose: this runs for every linear layer of every step."""
    m = x.shape[0]
    q = torch.empty((2 * m, x.shape[1]), dtype=torch.int8, device=x.device)
    scale = torch.empty((2 * m, 1), dtype=torch.float32, device=x.device)
    torch.div(x.abs().amax(dim=1, keepdim=True), ACTIVATION_MAX, out=scale[:m]).clamp_min_(MIN_SCALE)
    units = x / scale[:m]  # within [-63, 63]
    level1 = torch.round(units)
    q[:m].copy_(level1)
    q[m:].copy_(units.sub_(level1).mul_(RESIDUAL_LEVELS).round_())
    torch.div(scale[:m], RESIDUAL_LEVELS, out=scale[m:])
    return q, scale


_UNIT_SCALE = torch.tensor(1.0)
_ZERO_POINT = torch.tensor(0, dtype=torch.int32)
# oneDNN's int8 linear returns its integer products as fp32, exact while they stay below 2^24: with
# activations of at most 63 and weights of at most 127, rows of up to this many features.
PACKED_MAX_K = 2**24 // (int(ACTIVATION_MAX) * int(INT8_MAX))


def packed_int8_matmul(q: torch.Tensor, qw: Int8Weight) -> torch.Tensor:
    """q @ W^T in fp32 for int8 rows q [M, K], through oneDNN's packed kernel. Every scale is passed as 1:
    the products come back as whole numbers, dequantized by the caller."""
    return torch.ops.onednn.qlinear_pointwise.tensor(
        q, _UNIT_SCALE, _ZERO_POINT, qw.packed, qw.unit_scale, qw.zero_points, None,
        1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip


def int8_products(q: torch.Tensor, qw: Int8Weight) -> torch.Tensor:
    """q @ W^T, exact, int32 [M, N] for int8 rows q [M, K]: the packed kernel when the weight is packed
    (its fp32 results are whole numbers below 2^24, see PACKED_MAX_K), else `_int_mm`."""
    if qw.packed is not None:
        return packed_int8_matmul(q, qw).to(torch.int32)
    return torch._int_mm(q, qw.weight_t)  # noqa: SLF001 (PyTorch's exact int8 matmul has no public name)


def dequantize(
    acc: torch.Tensor, scale: torch.Tensor, qw: Int8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """fp32 [M, N] from the int32 products acc [2M, N] of `quantize_two_level`'s rows (scales `scale`) with
    the weight: the two levels meet in one exact integer, 126 * acc1 + acc2 (int64: no overflow at any K),
    converted once, times the channel scale, times the residual level's scale s / 126, plus the bias."""
    m = acc.shape[0] // 2
    exact = acc[:m].to(torch.int64).mul_(int(RESIDUAL_LEVELS)).add_(acc[m:])
    out = exact.to(torch.float32).mul_(qw.scale).mul_(scale[m:])
    return out.add_(bias) if bias is not None else out


def torch_w8a8_linear(x: torch.Tensor, qw: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`w8a8_linear` in PyTorch ops alone: the reference the fused kernels must reproduce."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    q, s = quantize_two_level(x2)
    out = dequantize(int8_products(q, qw), s, qw, bias)
    return out.view(*shape[:-1], out.shape[-1])
