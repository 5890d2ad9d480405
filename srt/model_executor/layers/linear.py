"""Linear layers split over the tensor-parallel ranks (Megatron-style pairs).

A column-parallel layer splits its output features: each rank computes its slice, no communication. A
row-parallel layer splits its input features, so it consumes a column-parallel output as is, and one
all-reduce sums the ranks' partial products. Attention (qkv -> o) and the MLP (gate_up -> down) each cost
one all-reduce per layer.

Both take their part of a checkpoint tensor through `checkpoint_slice`, which the declarative loader calls:
the loader keeps the shape check and the copy in one place, the layer alone knows which slice is its own.
At one rank every slice is the whole tensor and the layers compute exactly `nn.Linear`.

Every layer multiplies through the `LinearMethod` it was built with (`linear_method.py`): with
`--quantization w8a8_int8` the method holds the layer's (already sharded) weight in int8 once quantized; the
bias stays fp32. The output head is a `ReplicatedLinear` too, reading the input embedding's table when tied.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.model_executor.layers.linear_method import WEIGHT, LinearMethod
from srt.model_executor.parallel_state import TensorParallelGroup

# Rank that adds a row-parallel bias: added once before the all-reduce, it is in the sum exactly once.
BIAS_RANK = 0


def split_size(total: int, tp: TensorParallelGroup, what: str) -> int:
    if total % tp.size != 0:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {tp.size}")
    return total // tp.size


class LinearBase(nn.Module):
    """A layer with one [out, in] weight multiplied through its method (`LinearWeights` for the method)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    shape: tuple[int, int]  # this rank's [out, in]

    def __init__(self, method: LinearMethod | None):
        super().__init__()
        self.method = method or LinearMethod()

    def weight_keys(self) -> list[str]:
        return [WEIGHT]

    def dense_weight(self, key: str) -> torch.Tensor:
        return self.weight

    def weight_shape(self, key: str) -> tuple[int, int]:
        """This rank's [out, in] of weight `key`, held or not: a quantized method (GGUF blocks) may never
        have had a dense copy."""
        return self.shape

    def drop_dense_weights(self) -> None:
        self.register_parameter("weight", None)  # the fp32 copy is never read again


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; the output is the concatenation of checkpoint layers ("shards").

    Each rank holds its slice of every shard, in shard order (rank r of a fused qkv holds q_r, k_r, v_r), so
    splitting the local output by local shard sizes gives this rank's heads of q, k and v.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool,
        tp: TensorParallelGroup,
        method: LinearMethod | None = None,
    ):
        super().__init__(method)
        self.tp = tp
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard, size in shard_sizes.items():
            local = split_size(size, tp, f"output size of {shard}")
            self.shard_offsets[shard] = (offset, local)
            offset += local
        self.shape = (offset, in_features)
        self.weight = nn.Parameter(torch.empty(offset, in_features))
        self.bias = nn.Parameter(torch.empty(offset)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def checkpoint_slice(
        self, param: str, shard: str | None, tensor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(our parameter's region, the checkpoint rows that belong in it) for one shard's tensor."""
        offset, size = self.shard_offsets[shard]
        target = getattr(self, param).data.narrow(0, offset, size)
        return target, tensor.narrow(0, self.tp.rank * size, size)


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the ranks' partial outputs are summed by an all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallelGroup,
        method: LinearMethod | None = None,
    ):
        super().__init__(method)
        self.tp = tp
        self.in_local = split_size(in_features, tp, "input size of a row-parallel layer")
        self.shape = (out_features, self.in_local)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == BIAS_RANK else None
        return self.tp.all_reduce(self.method.apply(self, x, bias))

    def checkpoint_slice(
        self, param: str, shard: str | None, tensor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        target = getattr(self, param).data
        if param == "bias":  # replicated: every rank holds the whole bias
            return target, tensor
        return target, tensor.narrow(1, self.tp.rank * self.in_local, self.in_local)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (the output head). Tied to an embedding, it reads that table as its
    weight and holds none of its own (a second parameter would load, convert and quantize the table twice);
    an int8 method still gets its own int8 copy while the embedding stays fp32 for lookups."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        method: LinearMethod | None = None,
        tied_to: nn.Embedding | None = None,
    ):
        super().__init__(method)
        self.bias = None
        self.shape = (out_features, in_features)
        self._tied = (tied_to,)  # a tuple: not registered, so the embedding stays the embedding's own module
        weight = nn.Parameter(torch.empty(out_features, in_features)) if tied_to is None else None
        self.register_parameter("weight", weight)  # None when tied: `dense_weight` reads the embedding's

    @property
    def tied(self) -> bool:
        return self._tied[0] is not None

    def dense_weight(self, key: str) -> torch.Tensor:
        return self._tied[0].weight if self.tied else self.weight

    def drop_dense_weights(self) -> None:
        if not self.tied:  # the embedding's table stays: lookups read it
            super().drop_dense_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, None)
