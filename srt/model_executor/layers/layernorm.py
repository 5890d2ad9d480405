"""RMSNorm as Llama-family checkpoints define it: x / rms(x) * w, statistics in fp32 as transformers computes
them. Built with the int8 model's fused CPU kernels, it is one kernel call instead of six operations."""

from __future__ import annotations

import torch
from torch import nn

from srt.model_executor.layers.cpu_kernels import CpuKernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: CpuKernels | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rmsnorm(x, self.weight, self.eps)
        h = x.float()  # fp32 statistics, so reduced-precision runs normalize stably
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
