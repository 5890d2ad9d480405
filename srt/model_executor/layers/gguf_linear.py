"""GGUF weights multiplied in their own block formats (`cpu_gguf_kernels.c`), and embedding rows looked up in
them: the `gguf` linear method's arithmetic (`linear_method.GGUFLinearMethod`).

A `BlockMatrix` is one 2-D tensor of a GGUF file as it lies there (usually a view of the file's read-only
memory map): `rows` output features, each `row_bytes` of ggml blocks along the `cols` input features. Nothing
is converted, copied or calibrated: a decode step reads each weight block once from the page cache.

Activations are quantized per block of 32 to int8 (ggml's Q8_0, as llama.cpp does for these formats), once
per layer call, and multiplied in integers (vpdpbusd with AVX-512 VNNI, vpmaddubsw with AVX2, a portable loop
elsewhere: one per machine, as for srt's int8 kernels; cpu_gguf_kernels.c has the layouts). An output then
differs from the exact fp32 product of the dequantized weight by at most sum_i |w_i| * d_i / 2 (d_i: the
scale of input i's block, amax / 127): a step of 1/254 of the block's range, against the 1/15 (Q4) to 1/63
(Q6) of the weights' own rounding. `exact=True` keeps fp32 activations (each weight chunk dequantized in L1,
then fp32 products): the reference for end-to-end comparisons, and what F32/F16/BF16 rows always take.

The trade, measured (scripts/bench_gguf_gemm.py, one core of a 2-core Xeon with AVX-512 VNNI, each call
reading its weight from memory; docs/benchmarks/2026-11-29-intel-xeon-avx512-vnni-2core-gguf-gemm.md), ms
for a 2048 x 2048 weight at 1 and 16 token rows:

    Q4_K   int8 activations 0.34 / 1.9    exact fp32 1.4 / 8.3    srt's W8A8 int8 kernel 0.34 / 0.85
    Q6_K                    0.39 / 1.9               1.5 / 5.8

so the quantized activations are 4x faster at both sizes, and a batch-1 step runs the file's 4.5 bits about
as fast as srt's int8 copy of the same weight runs its 8 (reading 56 % of the bytes); 16 rows cost 2.2x the
int8 kernel's time (a scale multiply per 32 products, where the int8 kernel has one per row).

Every operand is checked here before a C call (type, shape, dtype, strides, ids in range): a bad call is a
Python exception, never a read past a tensor.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from srt.model_executor.layers.cpu_kernel_build import build
from srt.model_executor.layers.cpu_kernels import CpuKernels

_T = GGMLQuantizationType
QUANTIZED_TYPES = frozenset(
    int(t) for t in (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q4_K, _T.Q5_K, _T.Q6_K)
)
FLOAT_TYPES = frozenset(int(t) for t in (_T.F32, _T.F16, _T.BF16))
SUPPORTED_TYPES = QUANTIZED_TYPES | FLOAT_TYPES
# the activations' quantization block (QK in the C source): every quantized type's block is a multiple of it
ACTIVATION_BLOCK = 32


class UnsupportedBlockType(ValueError):
    """A tensor's ggml type has no kernel here (the message names the type)."""


def type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown ggml type {qtype}"


def block_shape(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block of `qtype`; UnsupportedBlockType for a type srt cannot run."""
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(type_name(t) for t in SUPPORTED_TYPES))
        raise UnsupportedBlockType(f"ggml type {type_name(qtype)} is not supported (srt runs {supported})")
    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


@dataclass(frozen=True, eq=False)
class BlockMatrix:
    """A [rows, cols] matrix in a ggml block format: `data` uint8 [rows, row_bytes] on the CPU, unit stride
    along a row (rows may lie any distance apart: a view of a file's map, or rows picked by an index).
    Checked once at construction; the kernels trust what passed."""

    qtype: int
    rows: int
    cols: int
    data: torch.Tensor

    def __post_init__(self):
        elements, nbytes = block_shape(self.qtype)
        what = f"{type_name(self.qtype)} matrix [{self.rows}, {self.cols}]"
        if self.rows < 0 or self.cols <= 0 or self.cols % elements:
            raise ValueError(f"{what}: cols must be a positive multiple of the block size {elements}")
        if self.qtype in QUANTIZED_TYPES and self.cols % ACTIVATION_BLOCK:
            raise ValueError(f"{what}: cols must be a multiple of {ACTIVATION_BLOCK}")
        d = self.data
        if d.dtype != torch.uint8 or d.device.type != "cpu" or d.dim() != 2:
            raise TypeError(
                f"{what}: data must be a 2-D uint8 CPU tensor, got {d.dtype} {tuple(d.shape)} on {d.device}"
            )
        if tuple(d.shape) != (self.rows, self.row_bytes):
            raise ValueError(
                f"{what}: data has shape {tuple(d.shape)}, expected {(self.rows, self.row_bytes)}"
            )
        if self.rows > 1 and (d.stride(1) != 1 or d.stride(0) < self.row_bytes):
            raise ValueError(f"{what}: each row's bytes must be contiguous and rows must not overlap")

    @property
    def row_bytes(self) -> int:
        elements, nbytes = block_shape(self.qtype)
        return self.cols // elements * nbytes

    @functools.cached_property
    def address(self) -> tuple[int, int]:
        """(the first row's address, the bytes from one row to the next): what the kernels read, taken once
        (a layer's call then costs one C call a part, not a tensor slice and checks a part)."""
        return self.data.data_ptr(), self.data.stride(0) if self.rows > 1 else self.row_bytes

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    @functools.cached_property
    def alone(self) -> BlockParts:
        """This matrix as the one part of a product (described for the C call once)."""
        return BlockParts((self,))

    def narrow(self, dim: int, start: int, length: int) -> BlockMatrix:
        """A view of the output rows (dim 0) or input columns (dim 1, on block boundaries) [start, start +
        length): a tensor-parallel shard (column-parallel splits rows, row-parallel columns) without a copy."""
        if dim == 0:
            return BlockMatrix(self.qtype, length, self.cols, self.data.narrow(0, start, length))
        if dim != 1:
            raise ValueError(f"a block matrix has dims 0 and 1, not {dim}")
        elements, nbytes = block_shape(self.qtype)
        if start % elements or length % elements or not 0 <= start <= start + length <= self.cols:
            raise ValueError(
                f"columns [{start}, {start + length}) of a {self.type_name} matrix of {self.cols}: a shard "
                f"must lie within it, on its {elements}-element blocks"
            )
        view = self.data.narrow(1, start // elements * nbytes, length // elements * nbytes)
        return BlockMatrix(self.qtype, self.rows, length, view)

    def select_rows(self, index: torch.Tensor) -> BlockMatrix:
        """The rows `index` (int64), in that order, as a new matrix (a copy of their bytes): rows are
        quantized along the input only, so any permutation of a weight's outputs is exact."""
        _check_ids(index, self.rows)
        return BlockMatrix(self.qtype, index.numel(), self.cols, self.data.index_select(0, index.reshape(-1)))


class BlockParts:
    """Block matrices stacked along the output (a fused qkv or gate_up: each part may have its own type),
    checked once and described for `srt_gguf_linear` once (the type, address, row stride and rows of each,
    PART_WORDS int64 words a part), so that a layer call is one C call."""

    def __init__(self, parts: list[BlockMatrix] | tuple[BlockMatrix, ...]):
        if not parts:
            raise ValueError("no block matrices to multiply")
        for p in parts:
            if not isinstance(p, BlockMatrix):
                raise TypeError(f"expected a BlockMatrix, got {type(p).__name__}")
            if p.cols != parts[0].cols:
                raise ValueError(
                    f"fused block matrices disagree on their input size ({p.cols} != {parts[0].cols})"
                )
        self.parts = tuple(parts)
        self.cols = parts[0].cols
        self.rows = sum(p.rows for p in parts)
        self.quantized = any(p.qtype in QUANTIZED_TYPES for p in parts)
        self.desc = torch.tensor([[p.qtype, *p.address, p.rows] for p in parts], dtype=torch.int64)


class GGUFKernels:
    """The C functions of one built kernel library, with checked entry points. `kernels()` is this
    process's; a test builds others (portable, AVX2) to compare them with it."""

    def __init__(self, lib: CpuKernels):
        self.isa = lib.isa
        self._quantize = lib.function("srt_gguf_quantize_rows")
        self._matmul = lib.function("srt_gguf_matmul")
        self._matmul_exact = lib.function("srt_gguf_matmul_exact")
        self._linear = lib.function("srt_gguf_linear")
        self._dequantize = lib.function("srt_gguf_dequantize_rows")
        self._act_row_bytes = lib.function("srt_gguf_act_row_bytes")
        self._act_bytes: dict[int, int] = {}
        # the C source and gguf's tables must agree on every block's size
        type_bytes, type_elements = (
            lib.function("srt_gguf_type_bytes"),
            lib.function("srt_gguf_type_elements"),
        )
        for t in SUPPORTED_TYPES:
            elements, nbytes = block_shape(t)
            if (type_elements(t), type_bytes(t)) != (elements, nbytes):
                raise RuntimeError(
                    f"the GGUF kernels disagree with gguf on the size of {type_name(t)} blocks"
                )

    def act_row_bytes(self, cols: int) -> int:
        """Bytes of one token's quantized activations (the C source's layout)."""
        if cols not in self._act_bytes:
            self._act_bytes[cols] = self._act_row_bytes(cols)
        return self._act_bytes[cols]

    def quantize_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [T, cols] (unit column stride, cols a multiple of 32) -> the kernels' int8 activation rows."""
        t, cols = x.shape
        act = torch.empty((t, self.act_row_bytes(cols)), dtype=torch.uint8)
        if t:
            self._quantize(x.data_ptr(), t, cols, x.stride(0), act.data_ptr())
        return act

    def matmul(
        self, x: torch.Tensor, parts: BlockParts | list[BlockMatrix], exact: bool = False
    ) -> torch.Tensor:
        """x fp32 [..., cols] times the parts' matrices stacked along the output: [..., sum of rows], in one
        C call. The activations are quantized once for all quantized parts, or kept in fp32 (`exact`: the
        product of the dequantized weights, slower; see the module's docstring)."""
        plan = parts if isinstance(parts, BlockParts) else BlockParts(parts)
        x2 = _activation_rows(x, plan.cols)
        t = x2.shape[0]
        out = torch.empty((t, plan.rows), dtype=torch.float32)
        if t and plan.rows:
            act = None
            if plan.quantized and not exact:
                act = torch.empty((t, self.act_row_bytes(plan.cols)), dtype=torch.uint8)
            rc = self._linear(
                x2.data_ptr(), t, plan.cols, x2.stride(0), len(plan.parts), plan.desc.data_ptr(),
                None if act is None else act.data_ptr(), out.data_ptr(), plan.rows,
            )  # fmt: skip
            if rc != 0:
                names = ", ".join(p.type_name for p in plan.parts)
                raise UnsupportedBlockType(f"the GGUF kernels do not take these block types: {names}")
        return out.view(*x.shape[:-1], plan.rows)

    def dequantize_rows(self, m: BlockMatrix, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [*ids.shape, cols]: the rows `ids` (int64) dequantized exactly as gguf-py's dequantize."""
        _check_ids(ids, m.rows)
        flat = ids.reshape(-1).contiguous()
        out = torch.empty((flat.numel(), m.cols), dtype=torch.float32)
        if flat.numel():
            w, w_stride = m.address
            rc = self._dequantize(m.qtype, w, w_stride, m.cols, flat.data_ptr(), flat.numel(), out.data_ptr())
            if rc != 0:
                raise UnsupportedBlockType(f"the GGUF kernels do not take ggml type {m.type_name}")
        return out.view(*ids.shape, m.cols)


def _activation_rows(x: torch.Tensor, cols: int) -> torch.Tensor:
    """x as fp32 rows [T, cols] with unit column stride (a view where it is one already)."""
    if x.dtype is not torch.float32 or not x.is_cpu:
        raise TypeError(f"GGUF matmul takes fp32 CPU activations, got {x.dtype} on {x.device}")
    if x.dim() == 0 or x.shape[-1] != cols:
        raise ValueError(f"activations of shape {tuple(x.shape)} for a matrix of {cols} input features")
    x2 = x if x.dim() == 2 else x.reshape(-1, cols)
    return x2 if x2.stride(1) == 1 and x2.stride(0) >= cols else x2.contiguous()


def _check_ids(ids: torch.Tensor, rows: int) -> None:
    if ids.dtype != torch.int64 or ids.device.type != "cpu":
        raise TypeError(f"row ids must be int64 on the CPU, got {ids.dtype} on {ids.device}")
    if ids.numel() and bool((ids < 0).any() or (ids >= rows).any()):
        raise IndexError(f"row id out of range for a matrix of {rows} rows")


@functools.cache
def kernels(block_products: bool = True) -> GGUFKernels:
    """This process's GGUF kernels (the srt kernel library, built for this CPU at first use): for the block
    products, the library built for them; for dequantizing (`block_products=False`), the one every path
    loads, whose GGUF code dequantizes faster and compiles in half the time (`cpu_kernel_build`), so a
    `gguf_int8` start never builds the other. There is no fallback: a GGUF's blocks run here or not at all."""
    try:
        return GGUFKernels(CpuKernels(build(block_products=block_products)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        raise RuntimeError(
            f"the CPU kernels for GGUF block formats did not build: {str(detail)[-500:]}"
        ) from e


def block_matmul(x: torch.Tensor, m: BlockMatrix, exact: bool = False) -> torch.Tensor:
    """x fp32 [..., cols] -> fp32 [..., rows]: x times the block matrix's dequantized weight, transposed
    (activations quantized per block of 32 unless `exact`)."""
    return kernels().matmul(x, m.alone, exact)


def block_matmul_parts(
    x: torch.Tensor, parts: BlockParts | list[BlockMatrix], exact: bool = False
) -> torch.Tensor:
    """x times each part, concatenated along the output (a fused layer: the activations quantized once)."""
    return kernels().matmul(x, parts, exact)


def dequantize_rows(m: BlockMatrix, rows: torch.Tensor) -> torch.Tensor:
    """fp32 [*rows.shape, cols]: rows of the matrix (an embedding lookup), exactly as gguf dequantizes them."""
    return kernels(block_products=False).dequantize_rows(m, rows)
