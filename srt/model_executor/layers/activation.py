"""The gated activations of the MLPs, over the fused gate/up projection's output (gate columns first)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.model_executor.layers.cpu_kernels import CpuKernels


class SiluAndMul:
    """silu(gate) * up (SwiGLU); one fused CPU kernel call where built with the int8 model's kernels."""

    def __init__(self, inter: int, kernels: CpuKernels | None = None):
        self.inter = inter
        self.kernels = kernels

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up, self.inter)
        gate, up = gate_up.split(self.inter, dim=-1)
        return F.silu(gate) * up
