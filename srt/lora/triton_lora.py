"""Triton kernels for a step's multi-LoRA products: each segment's shrink (x A^T at the adapter's rank) and
expand (times B^T, each sub-module into its own output columns), added to the base output in place.

They compute what `LayerLoRAWeights.add_delta`'s PyTorch path does, from the same pool layout: the shrink
kernel writes every adapted row's stacked sub-module products to an fp32 scratch, and the expand kernel
adds each row's delta to its own block of `out` (one program per block, so no atomics). The rank varies by
segment and is read from the table, so the pool's padding beyond it is never read. Every shape and grid
depends only on the pool, the step's row count and the host's longest segment, never on the table's or
`order`'s contents: with both in static buffers, a launch can be captured in a CUDA graph and replayed
after they change (as long as no segment grows past `max_segment_rows`).

Loops are bounded by constexprs (the input width, the pool's rank, a block past the adapter's skipped):
Triton 3.6's interpreter cannot bound a loop by a kernel argument or a loaded value under numpy >= 2.4, and
a layer's widths are fixed, so each layer shape compiles once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.model_executor.attention.triton_launch import MIN_DOT_DIM, dot_precision

# Segments are short (a decode step's rows of one adapter), so the row blocks are tl.dot's minimum; so are
# the rank blocks, which common ranks (8, 16, 32, 64) fill well.
BLOCK_M = MIN_DOT_DIM
BLOCK_R = MIN_DOT_DIM
# the shrink's input-feature chunk and the expand's output columns: a 16 x 64 tile per load keeps the
# memory pipeline busy while the fp32 accumulators stay small
BLOCK_K = 64
BLOCK_N = 64
MAX_SUBMODULES = 3  # q, k and v: the expand kernel's sub-module arguments are unrolled up to this many


@triton.jit
def _segment_rows(Table, Order, seg, HAS_ORDER: tl.constexpr, BLOCK_M: tl.constexpr):
    """The segment's slot and rank, this program's block of positions in `order`, their mask, and their
    rows of x and out (order[pos], or the positions themselves without an order)."""
    slot = tl.load(Table + seg * 4)
    rank = tl.load(Table + seg * 4 + 1)
    start = tl.load(Table + seg * 4 + 2)
    end = tl.load(Table + seg * 4 + 3)
    pos = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pos_mask = pos < end
    if HAS_ORDER:
        rows = tl.load(Order + pos, mask=pos_mask, other=0)
    else:
        rows = pos
    return slot, rank, start, end, pos, pos_mask, rows


@triton.jit
def shrink_kernel(
    X, A, Table, Order, Shrunk, stride_x, stride_a_slot, stride_a_row, stride_shrunk,
    IN_FEATURES: tl.constexpr, NSUB: tl.constexpr, HAS_ORDER: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (segment, block of its rows, block of its stacked A rows): Shrunk[pos] = x[row] @ A[slot, :NSUB *
    rank].T, for the columns below NSUB * rank (those beyond are left unwritten: the expand never reads
    them)."""
    seg = tl.program_id(0)
    slot, rank, start, end, pos, pos_mask, rows = _segment_rows(Table, Order, seg, HAS_ORDER, BLOCK_M)
    width = NSUB * rank
    col0 = tl.program_id(2) * BLOCK_R
    if (start + tl.program_id(1) * BLOCK_M >= end) | (col0 >= width):
        return
    cols = col0 + tl.arange(0, BLOCK_R)
    col_mask = cols < width
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    x_rows = X + rows[:, None] * stride_x
    a_rows = A + slot * stride_a_slot + cols[None, :] * stride_a_row
    for k0 in range(0, IN_FEATURES, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < IN_FEATURES
        x = tl.load(x_rows + k[None, :], mask=pos_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_rows + k[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(
        Shrunk + pos[:, None] * stride_shrunk + cols[None, :], acc, mask=pos_mask[:, None] & col_mask[None, :]
    )


@triton.jit
def _expand_submodule(
    acc, covered, Shrunk, B, pos, pos_mask, slot, rank, n, index, offset, size, stride_shrunk,
    stride_b_slot, stride_b_rank, MAX_RANK: tl.constexpr, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Add sub-module `index`'s product to the block's columns that are its own (offset..offset+size); a
    block that holds none of them skips the loads."""
    n_mask = (n >= offset) & (n < offset + size)
    n0 = tl.program_id(2) * BLOCK_N
    if (n0 < offset + size) & (n0 + BLOCK_N > offset):
        s_rows = Shrunk + pos[:, None] * stride_shrunk + index * rank
        b_cols = B + slot * stride_b_slot + n[None, :]
        for r0 in range(0, MAX_RANK, BLOCK_R):
            if r0 < rank:
                r = r0 + tl.arange(0, BLOCK_R)
                r_mask = r < rank
                s = tl.load(s_rows + r[None, :], mask=pos_mask[:, None] & r_mask[None, :], other=0.0)
                b = tl.load(
                    b_cols + r[:, None] * stride_b_rank, mask=r_mask[:, None] & n_mask[None, :], other=0.0
                )
                # the shrunk rows in the pool's dtype, as the PyTorch path multiplies them
                acc += tl.dot(s.to(b.dtype), b, input_precision=PRECISION)
    return acc, covered | n_mask


@triton.jit
def expand_kernel(
    Out, Shrunk, B, Table, Order, out_features, stride_out, stride_shrunk, stride_b_slot, stride_b_rank,
    offset0, size0, offset1, size1, offset2, size2,
    NSUB: tl.constexpr, MAX_RANK: tl.constexpr, HAS_ORDER: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One (segment, block of its rows, block of output columns): out[row, cols] += each sub-module's
    Shrunk[pos, its rank rows] @ B[slot, :rank, cols], in fp32, stored once; columns outside every
    sub-module's range are left as they are."""
    seg = tl.program_id(0)
    slot, rank, start, end, pos, pos_mask, rows = _segment_rows(Table, Order, seg, HAS_ORDER, BLOCK_M)
    if start + tl.program_id(1) * BLOCK_M >= end:
        return
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    covered = n < 0
    acc, covered = _expand_submodule(
        acc, covered, Shrunk, B, pos, pos_mask, slot, rank, n, 0, offset0, size0, stride_shrunk,
        stride_b_slot, stride_b_rank, MAX_RANK, PRECISION, BLOCK_R, BLOCK_N,
    )  # fmt: skip
    if NSUB > 1:
        acc, covered = _expand_submodule(
            acc, covered, Shrunk, B, pos, pos_mask, slot, rank, n, 1, offset1, size1, stride_shrunk,
            stride_b_slot, stride_b_rank, MAX_RANK, PRECISION, BLOCK_R, BLOCK_N,
        )  # fmt: skip
    if NSUB > 2:
        acc, covered = _expand_submodule(
            acc, covered, Shrunk, B, pos, pos_mask, slot, rank, n, 2, offset2, size2, stride_shrunk,
            stride_b_slot, stride_b_rank, MAX_RANK, PRECISION, BLOCK_R, BLOCK_N,
        )  # fmt: skip
    mask = pos_mask[:, None] & (covered & (n < out_features))[None, :]
    ptrs = Out + rows[:, None] * stride_out + n[None, :]
    base = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (base.to(tl.float32) + acc).to(base.dtype), mask=mask)


def add_delta(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    order: torch.Tensor | None,
    table: torch.Tensor,
    out_offsets: tuple[int, ...],
    out_sizes: tuple[int, ...],
    max_segment_rows: int,
) -> torch.Tensor:
    """`out` [T, out] plus each adapted row's delta, in place: `x` [T, in], the pool's `a` [slots, nsub x
    max rank, in] and `b` [slots, max rank, out], `table` [segments, 4] of (slot, rank, start, end) over
    `order` (None: the positions are the rows), all on the device. `max_segment_rows` (the host's longest
    segment) sizes the grids, so nothing here reads the device tensors' contents."""
    nsub = len(out_offsets)
    if not 0 < nsub <= MAX_SUBMODULES or len(out_sizes) != nsub:
        raise ValueError(f"1..{MAX_SUBMODULES} sub-modules, each with an offset and a size: not {nsub}")
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("x and out must be row-major (last stride 1)")
    if not x.dtype == out.dtype == a.dtype == b.dtype:
        raise ValueError(
            f"x, out and the pool must share a dtype: {x.dtype}, {out.dtype}, {a.dtype}, {b.dtype}"
        )
    nseg = table.shape[0]
    if nseg == 0 or max_segment_rows <= 0:
        return out
    in_features, out_features = x.shape[1], out.shape[1]
    stacked = a.shape[1]  # nsub x max rank
    positions = x.shape[0] if order is None else order.shape[0]
    shrunk = torch.empty((positions, stacked), dtype=torch.float32, device=x.device)
    has_order = order is not None
    order_arg = order if has_order else table  # never read without an order
    precision = dot_precision(a.dtype)
    row_blocks = triton.cdiv(max_segment_rows, BLOCK_M)
    shrink_kernel[(nseg, row_blocks, triton.cdiv(stacked, BLOCK_R))](
        x, a, table, order_arg, shrunk, x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        IN_FEATURES=in_features, NSUB=nsub, HAS_ORDER=has_order, PRECISION=precision, BLOCK_M=BLOCK_M,
        BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    subs = [arg for pair in zip(out_offsets, out_sizes, strict=True) for arg in pair]
    subs += [0] * (2 * MAX_SUBMODULES - len(subs))
    expand_kernel[(nseg, row_blocks, triton.cdiv(out_features, BLOCK_N))](
        out, shrunk, b, table, order_arg, out_features, out.stride(0), shrunk.stride(0), b.stride(0),
        b.stride(1), *subs, NSUB=nsub, MAX_RANK=b.shape[1], HAS_ORDER=has_order, PRECISION=precision,
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return out
