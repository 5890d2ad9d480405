"""A linear layer's adapter slots, and the linear method that adds their products to the base layer's.

`LoRALinearMethod` wraps the layer's own method (unquantized or int8) on the linear-method seam: the base
output first, then, for the step's adapted rows only, each adapter's segment shrink (x A^T, at the
adapter's rank) and expand (times B^T, the scaling folded into B when the slot was written). A fused layer
stacks its sub-modules' A (q, k, v's rows one after another) for one shrink, and expands each sub-module
into its own columns of the output. The adapter matmuls run in the pool's dtype (fp32 on the CPU), except
under the int8 base on the CPU, whose C kernel reads factors stored in fp16 and multiplies them in fp32
(`KERNEL_POOL_DTYPE`).

Tensor parallelism is exact with no extra communication: a column-parallel layer's slots hold this rank's
rows of B (its slice of each sub-module's outputs) and all of A; a row-parallel layer's slots hold this
rank's columns of A and all of B, so each rank's delta is a partial sum that the layer's own all-reduce
completes, as it completes the base product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.lora.adapter import LoRAAdapter
from srt.lora.batch_info import LoRABatchInfo, LoRAStep
from srt.model_executor.layers.linear_method import WEIGHT, LinearMethod, LinearWeights

# The int8 CPU path's pool: its steps are bound by reading memory, and an adapter's fp32 factors were ~3 of
# the ~6 ms four adapters added to a 16-row SmolLM2 decode step (2-core AMD EPYC Zen 4). Halved in fp16; the
# kernel widens them exactly and keeps every product and sum in fp32, so only the factors' rounding changes
# (relative 2^-11, inside the int8 base's own quantization error).
KERNEL_POOL_DTYPE = torch.float16


@dataclass(frozen=True)
class SubModule:
    """One checkpoint module inside an adapted layer (q_proj of qkv_proj, or o_proj alone)."""

    path: str  # PEFT's module path, e.g. model.layers.0.self_attn.q_proj
    index: int  # its place in the layer's stack of A rows
    out_offset: int  # its columns of this rank's output
    out_size: int
    fan_out: int  # its output size over all ranks (the checkpoint's)


class LayerLoRAWeights:
    """The pool's slots for one layer: A [slots, sub-modules x max rank, in] (an adapter of rank r keeps its
    sub-modules' A at rows i*r..(i+1)*r, so a shrink reads one contiguous block) and B^T [slots, max rank, out],
    this rank's part of each. A slot never written, or cleared, is zeros."""

    def __init__(
        self,
        subs: tuple[SubModule, ...],
        in_local: int,
        out_local: int,
        in_offset: int | None,
        tp_rank: int,
        slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: str,
        kernels=None,
        triton: bool = False,
    ):
        """`kernels` (srt's CPU kernels, for an fp32 model on the CPU): a step's products in one call of
        srt_lora_add_segments instead of PyTorch matmuls per segment and sub-module, on a pool of
        KERNEL_POOL_DTYPE. `triton`: the products by srt's Triton kernels (--lora-backend triton)."""
        self.subs = subs
        if triton:
            from srt.lora import triton_lora  # imports triton: only for this backend

            self._triton = triton_lora
        else:
            self._triton = None
        kernels = kernels if dtype == torch.float32 and str(device) == "cpu" and not triton else None
        dtype = KERNEL_POOL_DTYPE if kernels is not None else dtype
        self._columns = (tuple(s.out_offset for s in subs), tuple(s.out_size for s in subs))
        self._out_offsets, self._out_sizes = (torch.tensor(c, dtype=torch.int64) for c in self._columns)
        self.in_offset = in_offset  # row-parallel: this rank's first input column; None: all of them
        self.tp_rank = tp_rank
        self.a = torch.zeros((slots, len(subs) * max_rank, in_local), dtype=dtype, device=device)
        # B transposed, [slots, max rank, out]: the expand is then r row-times-matrix updates, which the CPU
        # kernel runs as contiguous vector updates of the output row
        self.b = torch.zeros((slots, max_rank, out_local), dtype=dtype, device=device)
        # bound once, called on this pool and each step's table: both valid where they are made (the pool's
        # shapes here, the table by LoRABatchInfo.build from loaded adapters' slots and ranks), so a layer
        # call skips CpuKernels.lora_add_segments' per-call checks (~50 us each, 120 calls a step)
        self._lora_add = None if kernels is None else kernels.function("srt_lora_add_segments")
        self._segment_args = None if kernels is None else (
            self.a.data_ptr(), self.a.stride(0), len(subs), self.b.data_ptr(), self.b.stride(0),
            self.b.stride(1), self._out_offsets.data_ptr(), self._out_sizes.data_ptr(),
            int(dtype == torch.float16),
        )  # fmt: skip

    def segment_args(self) -> tuple[int, ...] | None:
        """srt_lora_add_segments' layer operands, after (x, k, x_stride, rows, segments, table): the pool by
        address (its tensors live as long as the model), for a direct call. None without the kernels."""
        return self._segment_args

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        self.clear(slot)
        r, in_local = adapter.rank, self.a.shape[2]
        for sub in self.subs:
            if sub.path not in adapter.weights:
                continue
            a, b = adapter.weights[sub.path]
            if self.in_offset is not None:
                a = a[:, self.in_offset : self.in_offset + in_local]
            if sub.out_size != sub.fan_out:  # column-parallel: this rank's rows of the sub-module's output
                b = b[self.tp_rank * sub.out_size : (self.tp_rank + 1) * sub.out_size]
            self.a[slot, sub.index * r : (sub.index + 1) * r].copy_(a)
            self.b[slot, :r, sub.out_offset : sub.out_offset + sub.out_size].copy_((b * adapter.scaling).T)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add_delta(self, out: torch.Tensor, x: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        """`out` (the base product of `x`, in the pool's dtype) plus each adapted row's delta, in place."""
        if self._triton is not None:
            offsets, sizes = self._columns
            return self._triton.add_delta(
                out, x, self.a, self.b, info.order, info.device_table, offsets, sizes, info.max_segment_rows
            )
        if (
            self._lora_add is not None
            and x.stride(-1) == 1
            and out.stride(-1) == 1
            and x.dtype == torch.float32
        ):
            self._lora_add(
                x.data_ptr(), x.shape[1], x.stride(0), *info.kernel_segments(), *self._segment_args,
                out.data_ptr(), out.stride(0),
            )  # fmt: skip
            return out
        if info.order is None:  # every row adapted, already grouped: expand straight into `out`
            xs, deltas = x, out
        else:
            xs = x.index_select(0, info.order)
            deltas = torch.zeros((xs.shape[0], out.shape[1]), dtype=out.dtype, device=out.device)
        stacked = len(self.subs)
        for seg in info.segments:
            r, rows = seg.rank, deltas[seg.start : seg.end]
            shrunk = xs[seg.start : seg.end] @ self.a[seg.slot, : stacked * r].T.to(xs.dtype)
            for sub in self.subs:
                cols = slice(sub.out_offset, sub.out_offset + sub.out_size)
                rows[:, cols].addmm_(
                    shrunk[:, sub.index * r : (sub.index + 1) * r], self.b[seg.slot, :r, cols].to(xs.dtype)
                )
        return out if info.order is None else out.index_add_(0, info.order, deltas)


class LoRALinearMethod(LinearMethod):
    """The layer's base method plus the step's adapters. Only the layer's plain weight is adapted (an expert's
    keys pass through); the int8 form and its installation are the base method's."""

    def __init__(self, base: LinearMethod, weights: LayerLoRAWeights, step: LoRAStep):
        self.base, self.weights, self.step = base, weights, step
        self.name = base.name

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None, key: str = WEIGHT):
        return self.add_adapters(self.base.apply(layer, x, bias, key), x, key)

    def add_adapters(self, out: torch.Tensor, x: torch.Tensor, key: str = WEIGHT) -> torch.Tensor:
        info = self.step.info
        if info is None or key != WEIGHT:
            return out
        return self.weights.add_delta(out, x, info)

    def segment_args(self) -> tuple[int, ...] | None:
        return self.weights.segment_args()

    def step_adapters(self) -> LoRABatchInfo | None:
        return self.step.info

    def int8_weight(self, key: str = WEIGHT):
        return self.base.int8_weight(key)

    def block_parts(self, key: str = WEIGHT):
        return self.base.block_parts(key)

    def install(self, layer: LinearWeights, weights) -> None:
        self.base.install(layer, weights)
