"""Paged-attention Triton kernels that read K/V in place from the token pool, through `req_to_token`.

Decode is split-KV ("flash-decoding"): stage 1 gives each (sequence, KV head, split) program a contiguous
share of the sequence's positions, computed in the kernel from `seq_lens`, and writes a partial softmax
(normalised output and log-sum-exp) to an fp32 scratch; stage 2 merges the splits. Every shape and grid
depends only on the batch size and the model's head counts, never on sequence lengths, so a CUDA graph
captured once replays correctly whatever `seq_lens`/`req_to_token` hold.

Extend runs one launch per layer for all sequences of the step; each new token attends causally to its
sequence's cached prefix, read in place from the pool, and the new tokens up to itself, read from the step's
own contiguous K/V. Skipping the slot lookup for those took a cold 8,000-token prefill's attention from 0.34
to 0.25 ms a layer at SmolLM2's shape and from 2.19 to 1.62 ms at Llama-3-8B's, on an H100
(scripts/bench_triton_attention.py).

Sliding windows and logit soft-caps (Mistral's, Gemma 2's) are per-layer kernel arguments behind
`tl.constexpr` flags, so a plain layer compiles to the same code as before. With a window W the token at
position p sees positions p - W + 1 .. p: a decode split covers only its share of the window, and an extend
tile starts at its first row's lower bound, so keys before every row's window are never read (a long
sequence costs O(W)). A soft-cap c turns each scaled score s into c * tanh(s / c) before the softmax.

Softmax statistics and accumulators are fp32; fp32 inputs are multiplied at full precision ("ieee", not
tf32) so an fp32 model attends as precisely as the PyTorch reference.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Decode splits each sequence's KV into this many shares: enough programs to fill an H100's 132 SMs at
# batch 1 with 8 KV heads, few enough that merging costs nothing. A power of two (stage 2 uses tl.arange).
NUM_KV_SPLITS = 16
# KV positions per loop step: 64 rows of K/V per load keeps the memory pipeline busy on an H100.
DECODE_BLOCK_N = 64
# tl.dot needs every dimension >= 16: a KV group's query heads are padded to at least this many rows.
MIN_DOT_DIM = 16
# Extend tiles: 64 queries x 64 keys is the usual H100 sweet spot for head_dim <= 128...
EXTEND_BLOCK_M = 64
EXTEND_BLOCK_N = 64
# ...and half that for wider heads (or fp32 with head_dim 128), so the fp32 accumulator stays in registers
# and the K/V pipeline stages fit in shared memory.
EXTEND_SMALL_BLOCK = 32
LARGE_HEAD_DIM = 128
NUM_WARPS = 4
# software-pipelining depth of the extend kernel's key/value loads (Triton's default on Hopper)
EXTEND_NUM_STAGES = 3
MAX_HEAD_DIM = 256  # widest head the register tiles are sized for
LOG2_E: tl.constexpr = tl.constexpr(math.log2(math.e))


@triton.jit
def _soft_cap(scores, logit_cap):
    """logit_cap * tanh(scores / logit_cap), as cap - 2 cap / (1 + e^(2 s / cap)): one exp2 and one
    approximate division (2 ulp), which every Triton backend and the CPU interpreter have: a capped extend
    took 14-27% less time on an H200 than with 2 sigmoid(2x) - 1 and its IEEE division, as accurately."""
    e = tl.exp2(scores * (2 * LOG2_E / logit_cap))  # inf for large scores: the cap itself
    return logit_cap - tl.math.fdiv(2 * logit_cap, 1 + e)


@triton.jit
def _attend_block(
    q, k, v, acc, m_i, l_i, visible, sm_scale, logit_cap,
    MASKED: tl.constexpr, CAPPED: tl.constexpr, EMPTY_ROWS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The online-softmax update of a block of queries by a block of keys and values: scores (soft-capped
    when CAPPED), the running max and sum, the rescaled accumulator. `visible` (used when MASKED) says which
    scores count. Without EMPTY_ROWS every row must already have, or get in this block, at least one visible
    key, so its max stays finite; with it (sliding windows: a tile's later rows may see nothing of an early
    block) a row that has seen no key yet keeps a max of -inf and a zero sum and accumulator."""
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * sm_scale
    if CAPPED:
        scores = _soft_cap(scores, logit_cap)
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    if EMPTY_ROWS:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - 0) = 0, not exp(-inf + inf) = NaN
    else:
        m_shift = m_new
    alpha = tl.exp(m_i - m_shift)
    p = tl.exp(scores - m_shift[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_pool_range(
    q, acc, m_i, l_i, start, end, Slots, K, V, stride_k_slot, stride_v_slot, k_head_offset, v_head_offset,
    d, d_mask, sm_scale, logit_cap, row_lo,
    BLOCK_N: tl.constexpr, CAPPED: tl.constexpr, ROW_WINDOWS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Attend to positions start..end-1 of one sequence, read in place from the pool: `Slots` points at the
    sequence's req_to_token row, whose entries are the pool slots of its positions. With ROW_WINDOWS query
    row r sees only positions from row_lo[r] on (its sliding window's first)."""
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        slots = tl.load(Slots + pos, mask=p_mask, other=0)
        kv_mask = p_mask[:, None] & d_mask[None, :]
        # masked rows load zeros, not garbage: p = 0 times NaN would be NaN
        k = tl.load(K + slots[:, None] * stride_k_slot + k_head_offset + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slots[:, None] * stride_v_slot + v_head_offset + d[None, :], mask=kv_mask, other=0.0)
        if ROW_WINDOWS:
            visible = p_mask[None, :] & (pos[None, :] >= row_lo[:, None])
        else:
            visible = p_mask[None, :]
        acc, m_i, l_i = _attend_block(
            q, k, v, acc, m_i, l_i, visible, sm_scale, logit_cap, True, CAPPED, ROW_WINDOWS, PRECISION
        )
    return acc, m_i, l_i


@triton.jit
def _decode_split_kernel(
    Q, K, V, ReqToToken, ReqPoolIndices, SeqLens, PartialOut, PartialLse, sm_scale, window, logit_cap,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_row,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, WINDOWED: tl.constexpr, CAPPED: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head, split): the GROUP query heads of the KV head against its share of KV. With
    WINDOWED the splits share only the last `window` positions; the earlier ones are never read."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    if WINDOWED:
        lo = tl.maximum(seq_len - window, 0)
        share = tl.cdiv(seq_len - lo, NUM_SPLITS)
        start = lo + split * share
    else:
        share = tl.cdiv(seq_len, NUM_SPLITS)
        start = split * share
    end = tl.minimum(start + share, seq_len)  # start >= end: an empty split (a short sequence)
    row = tl.load(ReqPoolIndices + seq)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + h
    q_ptrs = Q + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # the block's first position is always valid, so every row max stays finite; every head has the one
    # query position, whose window the split range already is
    acc, m_i, l_i = _attend_pool_range(
        q, acc, m_i, l_i, start, end, ReqToToken + row * stride_row, K, V, stride_k_slot, stride_v_slot,
        kv_head * stride_k_head, kv_head * stride_v_head, d, d_mask, sm_scale, logit_cap, 0, BLOCK_N, CAPPED,
        False, PRECISION,
    )  # fmt: skip

    # an empty split (l_i = 0) weighs exp(-inf) = 0 in the merge and contributes zeros, not 0/0
    nonempty = end > start
    l_safe = tl.where(nonempty, l_i, 1.0)
    lse = tl.where(nonempty, m_i + tl.log(l_safe), float("-inf"))
    out = acc / l_safe[:, None]
    partial = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
    tl.store(PartialLse + partial, lse, mask=h_mask)
    tl.store(
        PartialOut + partial[:, None] * HEAD_DIM + d[None, :], out, mask=h_mask[:, None] & d_mask[None, :]
    )


@triton.jit
def _decode_merge_kernel(
    PartialOut, PartialLse, Out, stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """One (sequence, query head): the splits' outputs weighted by their share of the softmax mass."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = (seq * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(PartialLse + splits)
    weights = tl.exp(lse - tl.max(lse, 0))  # split 0 is never empty (seq_len >= 1): the max is finite
    parts = tl.load(PartialOut + splits[:, None] * HEAD_DIM + d[None, :], mask=d_mask[None, :], other=0.0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
    tl.store(Out + seq * stride_o_tok + head * stride_o_head + d, out.to(Out.dtype.element_ty), mask=d_mask)


@triton.jit
def _attend_new_range(
    q, acc, m_i, l_i, lo, hi, m, q_start, KNew, VNew, kn_head_offset, vn_head_offset, stride_kn_tok,
    stride_vn_tok, d, d_mask, sm_scale, logit_cap, window,
    DIAGONAL: tl.constexpr, WINDOW_EDGE: tl.constexpr, CAPPED: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Attend query rows m (indices into the sequence's new tokens) to its new tokens lo..hi-1, read from the
    step's contiguous k/v rows from q_start on; lo is a multiple of BLOCK_N. Masks: DIAGONAL, key j after
    row m or at/after hi (else every block is whole and no row sees a later key); WINDOW_EDGE, key j at or
    before m - window (a key before the row's sliding window)."""
    for block_start in range(lo, hi, BLOCK_N):
        j = block_start + tl.arange(0, BLOCK_N)
        if DIAGONAL:
            j_mask = j < hi
            kv_mask = j_mask[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(KNew + (q_start + j)[:, None] * stride_kn_tok + kn_head_offset + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        v = tl.load(VNew + (q_start + j)[:, None] * stride_vn_tok + vn_head_offset + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        if DIAGONAL:
            visible = (j[None, :] <= m[:, None]) & j_mask[None, :]
            if WINDOW_EDGE:
                visible = visible & (j[None, :] > m[:, None] - window)
        elif WINDOW_EDGE:
            visible = j[None, :] > m[:, None] - window
        else:
            visible = kv_mask  # unused: a whole block
        acc, m_i, l_i = _attend_block(
            q, k, v, acc, m_i, l_i, visible, sm_scale, logit_cap, DIAGONAL or WINDOW_EDGE, CAPPED, WINDOW_EDGE,
            PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _extend_kernel(
    Q, K, V, KNew, VNew, Out, ReqToToken, ReqPoolIndices, QStarts, NewLens, PrefixLens, sm_scale, window,
    logit_cap,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head, stride_o_tok, stride_o_head, stride_row,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, WINDOWED: tl.constexpr, CAPPED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (sequence, query head, block of BLOCK_M new tokens): new token j, at position prefix + j, sees
    positions 0..prefix+j, or with WINDOWED only the last `window` of them. The cached prefix comes from the
    pool through req_to_token; this step's own tokens come from the step's contiguous k/v rows (the same
    values the pool just received), which load without the slot indirection. Only the key blocks on the
    diagonal need the causal mask, and only those on the lower edge of the tile's windows the window mask;
    the blocks before the tile's first row's window are skipped."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_M
    num_new = tl.load(NewLens + seq)
    if first >= num_new:  # the grid is sized for the step's longest sequence
        return
    prefix = tl.load(PrefixLens + seq)
    q_start = tl.load(QStarts + seq)
    row = tl.load(ReqPoolIndices + seq)
    kv_head = head // GROUP

    m = first + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < num_new
    d_mask = d < HEAD_DIM
    tokens = q_start + m
    q_ptrs = Q + tokens[:, None] * stride_q_tok + head * stride_q_head + d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    slots = ReqToToken + row * stride_row
    k_head_offset = kv_head * stride_k_head
    v_head_offset = kv_head * stride_v_head
    if WINDOWED:
        # the cached prefix from the first row's window on; row m sees positions from prefix + m - window + 1
        acc, m_i, l_i = _attend_pool_range(
            q, acc, m_i, l_i, tl.maximum(prefix + first - window + 1, 0), prefix, slots, K, V, stride_k_slot,
            stride_v_slot, k_head_offset, v_head_offset, d, d_mask, sm_scale, logit_cap,
            prefix + m - window + 1, BLOCK_N, CAPPED, True, PRECISION,
        )  # fmt: skip
    else:
        # the cached prefix: every query row sees all of it
        acc, m_i, l_i = _attend_pool_range(
            q, acc, m_i, l_i, 0, prefix, slots, K, V, stride_k_slot, stride_v_slot, k_head_offset, v_head_offset,
            d, d_mask, sm_scale, logit_cap, 0, BLOCK_N, CAPPED, False, PRECISION,
        )  # fmt: skip
    # this step's tokens: rows at or after the block's first query see every new token up to `first`
    unmasked_end = ((first + 1) // BLOCK_N) * BLOCK_N
    new_end = tl.minimum(first + BLOCK_M, num_new)
    kn_head_offset = kv_head * stride_kn_head
    vn_head_offset = kv_head * stride_vn_head
    if WINDOWED:
        # from the block holding the first row's window start; up to `full_start` a block holds keys before
        # some row's window, after it every row (to the last, new_end - 1) sees whole blocks
        edge_start = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_start = tl.minimum(tl.cdiv(tl.maximum(new_end - window, 0), BLOCK_N) * BLOCK_N, unmasked_end)
        acc, m_i, l_i = _attend_new_range(
            q, acc, m_i, l_i, edge_start, full_start, m, q_start, KNew, VNew, kn_head_offset, vn_head_offset,
            stride_kn_tok, stride_vn_tok, d, d_mask, sm_scale, logit_cap, window, False, True, CAPPED, BLOCK_N,
            PRECISION,
        )  # fmt: skip
    else:
        full_start = 0
    acc, m_i, l_i = _attend_new_range(
        q, acc, m_i, l_i, full_start, unmasked_end, m, q_start, KNew, VNew, kn_head_offset, vn_head_offset,
        stride_kn_tok, stride_vn_tok, d, d_mask, sm_scale, logit_cap, window, False, False, CAPPED, BLOCK_N,
        PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend_new_range(
        q, acc, m_i, l_i, unmasked_end, new_end, m, q_start, KNew, VNew, kn_head_offset, vn_head_offset,
        stride_kn_tok, stride_vn_tok, d, d_mask, sm_scale, logit_cap, window, True, WINDOWED, CAPPED, BLOCK_N,
        PRECISION,
    )  # fmt: skip

    if WINDOWED:
        l_i = tl.where(m_mask, l_i, 1.0)  # a padding row past the sequence's end may have seen no key
    out = acc / l_i[:, None]
    o_ptrs = Out + tokens[:, None] * stride_o_tok + head * stride_o_head + d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@dataclass(frozen=True)
class ExtendTiles:
    """The extend kernel's launch shape (scripts/bench_triton_attention.py compares choices on a GPU)."""

    block_m: int
    block_n: int
    num_warps: int = NUM_WARPS
    num_stages: int = EXTEND_NUM_STAGES


def default_extend_tiles(width: int, dtype: torch.dtype) -> ExtendTiles:
    small = width > LARGE_HEAD_DIM or (width == LARGE_HEAD_DIM and dtype == torch.float32)
    if small:
        return ExtendTiles(EXTEND_SMALL_BLOCK, EXTEND_SMALL_BLOCK)
    return ExtendTiles(EXTEND_BLOCK_M, EXTEND_BLOCK_N)


def block_d(head_dim: int) -> int:
    """The padded head width the kernels tile with (masked beyond head_dim); raises for unsupported ones."""
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the triton attention backend supports head_dim 1..{MAX_HEAD_DIM}, not {head_dim}")
    return max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))


def window_and_cap_unsupported(sliding_window: int | None, logit_cap: float | None) -> str | None:
    """Why the kernels cannot take this window or cap (None when they can): a window of at least one
    position (the token's own), a positive finite cap."""
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        return f"a sliding window of {sliding_window!r} positions (the kernels take a whole number >= 1)"
    if logit_cap is not None and not (isinstance(logit_cap, int | float) and 0 < logit_cap < math.inf):
        return f"a logit soft-cap of {logit_cap!r} (the kernels take a positive finite number)"
    return None


def _window_and_cap(sliding_window: int | None, logit_cap: float | None) -> tuple[int, float]:
    """The kernels' window and cap arguments; 0 where a constexpr flag turns them off (then unused)."""
    reason = window_and_cap_unsupported(sliding_window, logit_cap)
    if reason is not None:
        raise ValueError(f"the triton attention kernels cannot take {reason}")
    return sliding_window or 0, float(logit_cap or 0.0)


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # the latter is ignored for 16-bit inputs


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    *,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> None:
    """out[b] = attention of q[b] `[bs, heads, head_dim]` over the first seq_lens[b] slots of row
    req_pool_indices[b], or only the last `sliding_window` of them; scores soft-capped at `logit_cap`. No
    host synchronisation: safe to capture in a CUDA graph (window and cap are the layer's constants)."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    # the scratch is allocated per call: inside a graph capture it comes from (and stays in) the graph's pool
    partial_out = torch.empty(bs, num_heads, NUM_KV_SPLITS, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(bs, num_heads, NUM_KV_SPLITS, dtype=torch.float32, device=q.device)
    width = block_d(head_dim)
    window, cap = _window_and_cap(sliding_window, logit_cap)
    _decode_split_kernel[(bs, num_kv_heads, NUM_KV_SPLITS)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, partial_out, partial_lse, scaling,
        window, cap, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(MIN_DOT_DIM, triton.next_power_of_2(group)),
        BLOCK_D=width, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=NUM_KV_SPLITS, WINDOWED=sliding_window is not None,
        CAPPED=logit_cap is not None, PRECISION=_precision(q), num_warps=NUM_WARPS,
    )  # fmt: skip
    _decode_merge_kernel[(bs, num_heads)](
        partial_out, partial_lse, out, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=width, NUM_SPLITS=NUM_KV_SPLITS, num_warps=NUM_WARPS,
    )  # fmt: skip


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    q_starts: torch.Tensor,
    new_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_new_tokens: int,
    scaling: float,
    tiles: ExtendTiles | None = None,
    *,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
) -> None:
    """Causal attention of every sequence's new tokens (rows q_starts[i] .. + new_lens[i] of q
    `[tokens, heads, head_dim]`) over its prefix_lens[i] cached tokens, read from the pool through
    req_to_token, and its new ones, whose keys and values are the same rows of k_new/v_new
    `[tokens, kv_heads, head_dim]`. New token j sits at position prefix_lens[i] + j; with `sliding_window`
    W it sees only positions from prefix_lens[i] + j - W + 1 on. Scores are soft-capped at `logit_cap`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    width = block_d(head_dim)
    tiles = tiles or default_extend_tiles(width, q.dtype)
    grid = (new_lens.shape[0], num_heads, triton.cdiv(max_new_tokens, tiles.block_m))
    window, cap = _window_and_cap(sliding_window, logit_cap)
    _extend_kernel[grid](
        q, k_buffer, v_buffer, k_new, v_new, out, req_to_token, req_pool_indices, q_starts, new_lens, prefix_lens,
        scaling, window, cap, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=width, WINDOWED=sliding_window is not None, CAPPED=logit_cap is not None,
        PRECISION=_precision(q), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def _fix_interpreter_scalar_index() -> None:
    """triton <= 3.6's interpreter turns a scalar loaded from memory into a Python int with `int()` of a
    one-element array, which numpy >= 2.4 refuses (triton-lang/triton#9171), so loops bounded by a loaded
    length fail under TRITON_INTERPRET=1. Wrap the interpreter's tensor patching to flatten first."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor  # noqa: SLF001 (patching Triton's interpreter)
    if getattr(original, "srt_fixed", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.srt_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor  # noqa: SLF001 (patching Triton's interpreter)


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_scalar_index()
