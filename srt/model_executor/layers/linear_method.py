"""How a linear layer multiplies: the seam between model code and quantization (and, later, adapters).

A layer gets its `LinearMethod` at construction and calls `method.apply(layer, x, bias, key)`; model code
never branches on which method it is. `key` names one weight of the layer: `WEIGHT` for a plain linear
layer, `"w13.3"` for expert 3's gate/up of a mixture of experts, so the experts run through the same seam.
A layer says what it holds through the small `LinearWeights` protocol below.

`W8A8Int8LinearMethod` runs the fp32 weights until `install` hands it their int8 form: calibration runs the
model in between, through the same layers. Which fused CPU operations (norms, rotary embedding, activation,
attention) a model's layers use is chosen with the method, in `LayerMethods`, and given to the layers when
they are built: nothing attaches kernels to a built model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.layers.cpu_kernels import CpuKernels
from srt.model_executor.layers.gguf_linear import BlockMatrix, BlockParts, block_matmul_parts
from srt.model_executor.layers.int8_linear import pack_weight, w8a8_linear
from srt.model_executor.layers.int8_math import Int8Weight

WEIGHT = "weight"  # the key of a plain linear layer's one weight


class LinearWeights(Protocol):
    """What a layer with a linear method exposes to it."""

    def weight_keys(self) -> list[str]:
        """The keys of its weights, each an [out, in] matrix."""

    def dense_weight(self, key: str) -> torch.Tensor:
        """The unquantized [out, in] weight named `key`."""

    def drop_dense_weights(self) -> None:
        """Free the unquantized weights (an int8 form replaced them)."""


class LinearMethod:
    name = "none"

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None, key: str = WEIGHT):
        return F.linear(x, layer.dense_weight(key), bias)

    def add_adapters(self, out: torch.Tensor, x: torch.Tensor, key: str = WEIGHT) -> torch.Tensor:
        """`out`, the base product of `x`, plus what this step's adapters add to it, in place (a method
        without adapters adds nothing). `apply` includes it; the fused CPU decode step, which runs the
        base product in its own kernel, calls it after."""
        return out

    def segment_args(self) -> tuple[int, ...] | None:
        """The layer's adapter pool as srt_lora_add_segments reads it, by address, for the fused CPU decode
        step's direct call (None: call `add_adapters`; a method without adapters never needs either)."""
        return None

    def step_adapters(self):
        """This step's adapter rows (`srt.lora.batch_info.LoRABatchInfo`), shared by every adapted layer;
        None: no row of the step has an adapter, or the method has none."""
        return None

    def int8_weight(self, key: str = WEIGHT) -> Int8Weight | None:
        """The int8 form of weight `key` (None: this method multiplies unquantized weights)."""
        return None

    def block_parts(self, key: str = WEIGHT) -> BlockParts | None:
        """Weight `key` as a GGUF file's blocks, described for `srt_gguf_linear` (None: not a GGUF method):
        the fused CPU decode step calls that kernel on them as `apply` does."""
        return None


class W8A8Int8LinearMethod(LinearMethod):
    """`--quantization w8a8_int8` (int8 weights per output channel, int8 activations per token; the numerics
    are in `int8_linear.py`)."""

    name = "w8a8_int8"

    def __init__(self):
        self.weights: dict[str, Int8Weight] | None = None

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None, key: str = WEIGHT):
        if self.weights is None:  # before `install`: the fp32 weights, which calibration runs
            return F.linear(x, layer.dense_weight(key), bias)
        return w8a8_linear(x, self.weights[key], bias)

    def install(self, layer: LinearWeights, weights: dict[str, Int8Weight]) -> None:
        """Take the layer's int8 `weights`, prepared for the fastest kernels here (`pack_weight`, which may
        drop a plain weight no kernel reads: save them first), wherever they come from: calibrated, cached,
        or rounded from a GGUF's blocks (`gguf_int8`), so every int8 weight runs the same kernels."""
        missing = set(layer.weight_keys()) - set(weights)
        if missing:
            raise KeyError(f"int8 weights missing for {sorted(missing)}")
        for qw in weights.values():
            pack_weight(qw)
        self.weights = weights
        layer.drop_dense_weights()

    def int8_weight(self, key: str = WEIGHT) -> Int8Weight | None:
        return None if self.weights is None else self.weights[key]


class GGUFLinearMethod(LinearMethod):
    """A GGUF file's weights in their own block formats (`gguf_linear.py`): each weight key holds its parts,
    stacked along the output in shard order (a fused qkv: [q, k, v], each with its own ggml type, as Q4_K_M
    files keep attn_v in Q6_K); the product is their concatenation. The layer never holds dense weights."""

    name = "gguf"

    def __init__(self):
        self.weights: dict[str, BlockParts] | None = None

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None, key: str = WEIGHT):
        if self.weights is None:
            raise RuntimeError("a gguf linear layer was called before its blocks were installed")
        out = block_matmul_parts(x, self.weights[key])
        return out if bias is None else out.add_(bias)

    def install(self, layer: LinearWeights, weights: dict[str, list[BlockMatrix]]) -> None:
        missing = set(layer.weight_keys()) - set(weights)
        if missing:
            raise KeyError(f"gguf weights missing for {sorted(missing)}")
        plans = {}
        for key, parts in weights.items():
            try:
                plans[key] = BlockParts(parts)  # checked and described for the C call once
            except ValueError as e:
                raise ValueError(f"gguf weight {key!r}: {e}") from e
        self.weights = plans
        layer.drop_dense_weights()

    def block_parts(self, key: str = WEIGHT) -> BlockParts | None:
        return None if self.weights is None else self.weights[key]


LINEAR_METHODS = {m.name: m for m in (LinearMethod, W8A8Int8LinearMethod, GGUFLinearMethod)}
# `--quantization gguf_int8`: a GGUF's weights as int8, made from its blocks at load (gguf_int8.py), then
# multiplied as any int8 weight
LINEAR_METHODS["gguf_int8"] = W8A8Int8LinearMethod
# The methods whose layers run srt's C kernels on the CPU, the fused norm/rope/attention ones with them
CPU_KERNEL_QUANTIZATIONS = ("w8a8_int8", "gguf", "gguf_int8")


@dataclass(frozen=True)
class LayerMethods:
    """What a model's layers are built with: their linear method (a new instance per layer, since it holds
    that layer's quantized weights) and the fused CPU kernels that norms, the rotary embedding, the MLP
    activation and attention use where given. The kernels come with int8 only: the fp32 path keeps
    PyTorch's operations, which transformers' outputs are compared with."""

    quantization: str = "none"
    cpu_kernels: CpuKernels | None = None

    @staticmethod
    def for_run(quantization: str, device: str) -> LayerMethods:
        if quantization not in LINEAR_METHODS:
            raise ValueError(f"unknown quantization {quantization!r}; choose one of {sorted(LINEAR_METHODS)}")
        if quantization not in CPU_KERNEL_QUANTIZATIONS or device != "cpu":
            return LayerMethods(quantization)
        # the block products' library only where the layers multiply blocks (cpu_kernel_build's docstring)
        block_products = LINEAR_METHODS[quantization] is GGUFLinearMethod
        return LayerMethods(quantization, cpu_kernels.load(block_products=block_products))

    def linear(self) -> LinearMethod:
        return LINEAR_METHODS[self.quantization]()


UNQUANTIZED = LayerMethods()
