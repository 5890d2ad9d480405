"""Linear layers split over the tensor-parallel ranks (Megatron-style pairs).

A column-parallel layer splits its output features: each rank computes its slice, no communication. A
row-parallel layer splits its input features, so it consumes a column-parallel output as is, and one
all-reduce sums the ranks' partial products. Attention (qkv -> o) and the MLP (gate_up -> down) each cost
one all-reduce per layer.

Both take their part of a checkpoint tensor through `checkpoint_slice`, which the declarative loader calls:
the loader keeps the shape check and the copy in one place, the layer alone knows which slice is its own.
At one rank every slice is the whole tensor and the layers compute exactly `nn.Linear`.

With `--quantization w8a8_int8` each layer's loaded (already sharded) fp32 weight is replaced by `quant`, an
`Int8Weight` (`int8_math.py`); the bias stays fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.model_executor.layers.int8_linear import w8a8_linear
from srt.model_executor.layers.int8_math import Int8Weight
from srt.model_executor.parallel_state import TensorParallelGroup

# Rank that adds a row-parallel bias: added once before the all-reduce, it is in the sum exactly once.
BIAS_RANK = 0


def split_size(total: int, tp: TensorParallelGroup, what: str) -> int:
    if total % tp.size != 0:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {tp.size}")
    return total // tp.size


class ColumnParallelLinear(nn.Module):
    """Output features split over ranks; the output is the concatenation of checkpoint layers ("shards").

    Each rank holds its slice of every shard, in shard order (rank r of a fused qkv holds q_r, k_r, v_r), so
    splitting the local output by local shard sizes gives this rank's heads of q, k and v.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard, size in shard_sizes.items():
            local = split_size(size, tp, f"output size of {shard}")
            self.shard_offsets[shard] = (offset, local)
            offset += local
        self.weight = nn.Parameter(torch.empty(offset, in_features))
        self.bias = nn.Parameter(torch.empty(offset)) if bias else None
        self.quant: Int8Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return w8a8_linear(x, self.quant, self.bias)
        return F.linear(x, self.weight, self.bias)

    def checkpoint_slice(
        self, param: str, shard: str | None, tensor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(our parameter's region, the checkpoint rows that belong in it) for one shard's tensor."""
        offset, size = self.shard_offsets[shard]
        target = getattr(self, param).data.narrow(0, offset, size)
        return target, tensor.narrow(0, self.tp.rank * size, size)


class RowParallelLinear(nn.Module):
    """Input features split over ranks; the ranks' partial outputs are summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.in_local = split_size(in_features, tp, "input size of a row-parallel layer")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.quant: Int8Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == BIAS_RANK else None
        if self.quant is not None:
            return self.tp.all_reduce(w8a8_linear(x, self.quant, bias))
        return self.tp.all_reduce(F.linear(x, self.weight, bias))

    def checkpoint_slice(
        self, param: str, shard: str | None, tensor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        target = getattr(self, param).data
        if param == "bias":  # replicated: every rank holds the whole bias
            return target, tensor
        return target, tensor.narrow(1, self.tp.rank * self.in_local, self.in_local)
