"""`--quantization gguf_int8`: a GGUF's linear weights as srt's int8 weights, made from the file's blocks at
load, for the models on which srt's int8 kernels beat the blocks' (`INT8_FROM_BLOCKS_MAX_PARAMS`).

On a small model a decode step's cost is less the bytes it reads than the work per weight, and there srt's
int8 kernels (one scale per output row) outrun the block kernels (a scale per 32 products): the fused
decode step of the embedded SmolLM2 runs about twice as fast on int8 as on its Q4_1 blocks. The old way to
int8 converted the file to an fp32 checkpoint and calibrated it (minutes); here each weight is dequantized
from the file's map a few rows at a time (`dequantize_rows`, exactly as gguf-py dequantizes) and each row
rounded to its nearest int8 level at the row's own scale (`quantize_per_channel`, the round-to-nearest of
`w8a8_int8` without GPTQ): no fp32 copy of a weight, let alone of the model, is ever held, nothing is
calibrated or cached. The file's rounding stays; this adds one more, at most half an int8 level of the row
(1/254 of its absmax), under the 1/15 (Q4) to 1/63 (Q6) of the blocks' own.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import torch

from srt.model_executor.gguf_file import GGUFFile
from srt.model_executor.layers.gguf_linear import QUANTIZED_TYPES, BlockMatrix, dequantize_rows
from srt.model_executor.layers.int8_math import INT8_MAX, Int8Weight, channel_scales
from srt.model_executor.layers.linear_method import WEIGHT, GGUFLinearMethod, W8A8Int8LinearMethod
from srt.model_executor.quantization import GGUF_INT8_QUANTIZATION, GGUF_QUANTIZATION

logger = logging.getLogger(__name__)

# The measured rule: a GGUF of at most this many parameters runs as int8 made from its blocks, a larger one
# its blocks. Decode steps of 256-token contexts, gguf / gguf_int8 time, medians of steps alternated one by
# one in one process on one core of the busy 2-core Xeon (AVX-512 VNNI; load average 8-12 from other work):
#   SmolLM2-135M (Q4_1, fused step)          batch 1: 1.29 (quartiles 1.10-1.43)   batch 16: 2.00
#   Gemma 3 270M (Q4_K_M, per-layer modules)  batch 1: 0.98 (0.93-1.12)             batch 16: 1.81
#   TinyLlama-1.1B shape (Q4_K_M, fused)      batch 1: 0.73 (0.67-0.74)             batch 16: 1.98
# int8 wins at batch 16 at every size, but at batch 1 the blocks' fewer bytes overtake it between 270M and
# 1.1B, and int8 holds a byte a parameter beside the file's map (1.1B: ~1.8 GB against llama.cpp's 1.24 GiB).
# The threshold sits between the two measured sides.
INT8_FROM_BLOCKS_MAX_PARAMS = 500_000_000
# fp32 values dequantized at a time (1 MiB, within a core's L2: the rounding's passes stay in cache; 15-30 %
# faster than 16 MiB on SmolLM2, noisy): the only float copy of a weight there ever is
DEQUANTIZE_CHUNK_VALUES = 1 << 18


def parameters(gguf: GGUFFile) -> int:
    """The file's parameters (every tensor's values: the weight matrices, then norms and biases)."""
    return sum(math.prod(t.shape) for t in gguf.tensors.values())


def gguf_method(gguf: GGUFFile) -> str:
    """What a GGUF runs on the CPU when --quantization does not say: int8 made from its blocks up to
    INT8_FROM_BLOCKS_MAX_PARAMS parameters, its blocks above. A file with a float weight matrix (F32, F16,
    BF16) keeps its blocks at any size: there the blocks multiply exactly, and int8 would be the only
    rounding, not one more."""
    quantized = all(t.ggml_type in QUANTIZED_TYPES for t in gguf.tensors.values() if len(t.shape) == 2)
    small = parameters(gguf) <= INT8_FROM_BLOCKS_MAX_PARAMS
    return GGUF_INT8_QUANTIZATION if quantized and small else GGUF_QUANTIZATION


def int8_from_blocks(parts: Sequence[BlockMatrix]) -> Int8Weight:
    """The block matrices stacked along the output (a fused layer's parts in shard order) as one int8 weight
    [rows, cols] with a scale per row: to the bit `int8_math.quantize_per_channel` of the dequantized
    values, computed DEQUANTIZE_CHUNK_VALUES at a time, in place (the chunk is the only float copy)."""
    cols = parts[0].cols
    if any(p.cols != cols for p in parts):
        raise ValueError(f"fused block matrices disagree on their input size ({[p.cols for p in parts]})")
    rows = sum(p.rows for p in parts)
    weight = torch.empty((rows, cols), dtype=torch.int8)
    scale = torch.empty(rows, dtype=torch.float32)
    step = max(1, DEQUANTIZE_CHUNK_VALUES // cols)
    first = 0
    for part in parts:
        for start in range(0, part.rows, step):
            n = min(step, part.rows - start)
            w = dequantize_rows(part, torch.arange(start, start + n))
            rows_scale = scale[first + start : first + start + n]
            rows_scale.copy_(channel_scales(w))
            levels = w.div_(rows_scale.unsqueeze(1)).round_().clamp_(-INT8_MAX, INT8_MAX)
            weight[first + start : first + start + n].copy_(levels)
        first += part.rows
    return Int8Weight(weight, scale)


class BlockInstaller:
    """Hands a layer the blocks of its weight as its method takes them: the blocks themselves (`gguf`), or
    int8 made from them (`gguf_int8`). Counts what it made, for the load's log line.

    The int8 weights go through the method's `install` as calibrated ones do, which prepares them for the
    same kernels (`int8_linear.pack_weight`: oneDNN's packed form where that kernel is exact and fast, for
    calls above the fused kernel's token counts; the plain weight where srt's C kernels read it). Where the
    packed kernel is oneDNN's slow fallback (the 2-core Xeon and AMD EPYC measured), both methods keep plain
    weights and run the same kernels: srt's int8 C kernel up to 128 tokens a call, `torch._int_mm` above."""

    def __init__(self):
        self.int8_weights = 0
        self.int8_seconds = 0.0
        self.packed = True  # every int8 weight made was packed for oneDNN (the log's word)

    def install(self, layer, parts: list[BlockMatrix]) -> None:
        method = layer.method
        if isinstance(method, GGUFLinearMethod):
            method.install(layer, {WEIGHT: parts})
        elif isinstance(method, W8A8Int8LinearMethod):
            start = time.monotonic()
            weight = int8_from_blocks(parts)
            method.install(layer, {WEIGHT: weight})
            self.packed = self.packed and weight.packed is not None
            self.int8_weights += 1
            self.int8_seconds += time.monotonic() - start
        else:
            raise TypeError(f"a GGUF's blocks cannot go to a {type(method).__name__}")

    def log(self, path: str) -> None:
        if self.int8_weights:
            logger.info(
                "gguf_int8: %d weights of %s made int8 from its blocks (%s) in %.2f s",
                self.int8_weights,
                path,
                "oneDNN packed kernel" if self.packed else "torch._int_mm",
                self.int8_seconds,
            )
