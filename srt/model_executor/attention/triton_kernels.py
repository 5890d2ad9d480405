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

Softmax statistics and accumulators are fp32; fp32 inputs are multiplied at full precision ("ieee", not
tf32) so an fp32 model attends as precisely as the PyTorch reference.
"""

from __future__ import annotations

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


@triton.jit
def _attend_block(q, k, v, acc, m_i, l_i, visible, sm_scale, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """The online-softmax update of a block of queries by a block of keys and values: scores, the running
    max and sum, the rescaled accumulator. `visible` (used when MASKED) says which scores count; every row
    must already have, or get in this block, at least one visible key, so its max stays finite."""
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * sm_scale
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_pool_range(
    q, acc, m_i, l_i, start, end, Slots, K, V, stride_k_slot, stride_v_slot, k_head_offset, v_head_offset,
    d, d_mask, sm_scale, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Attend to positions start..end-1 of one sequence, read in place from the pool: `Slots` points at the
    sequence's req_to_token row, whose entries are the pool slots of its positions."""
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        slots = tl.load(Slots + pos, mask=p_mask, other=0)
        kv_mask = p_mask[:, None] & d_mask[None, :]
        # masked rows load zeros, not garbage: p = 0 times NaN would be NaN
        k = tl.load(K + slots[:, None] * stride_k_slot + k_head_offset + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slots[:, None] * stride_v_slot + v_head_offset + d[None, :], mask=kv_mask, other=0.0)
        acc, m_i, l_i = _attend_block(q, k, v, acc, m_i, l_i, p_mask[None, :], sm_scale, True, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _decode_split_kernel(
    Q, K, V, ReqToToken, ReqPoolIndices, SeqLens, PartialOut, PartialLse, sm_scale,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_row,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head, split): the GROUP query heads of the KV head against its share of KV."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
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
    # the block's first position is always valid, so every row max stays finite
    acc, m_i, l_i = _attend_pool_range(
        q, acc, m_i, l_i, start, end, ReqToToken + row * stride_row, K, V, stride_k_slot, stride_v_slot,
        kv_head * stride_k_head, kv_head * stride_v_head, d, d_mask, sm_scale, BLOCK_N, PRECISION,
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
def _extend_kernel(
    Q, K, V, KNew, VNew, Out, ReqToToken, ReqPoolIndices, QStarts, NewLens, PrefixLens, sm_scale,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head, stride_o_tok, stride_o_head, stride_row,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (sequence, query head, block of BLOCK_M new tokens): new token j sees positions 0..prefix+j.
    The cached prefix comes from the pool through req_to_token; this step's own tokens come from the step's
    contiguous k/v rows (the same values the pool just received), which load without the slot indirection.
    Only the key blocks on the diagonal need the causal mask."""
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
    # the cached prefix: every query row sees all of it
    acc, m_i, l_i = _attend_pool_range(
        q, acc, m_i, l_i, 0, prefix, ReqToToken + row * stride_row, K, V, stride_k_slot, stride_v_slot,
        kv_head * stride_k_head, kv_head * stride_v_head, d, d_mask, sm_scale, BLOCK_N, PRECISION,
    )  # fmt: skip
    # this step's tokens: rows at or after the block's first query see every new token up to `first`
    unmasked_end = ((first + 1) // BLOCK_N) * BLOCK_N
    new_end = tl.minimum(first + BLOCK_M, num_new)
    for block_start in range(0, unmasked_end, BLOCK_N):
        rows = q_start + block_start + tl.arange(0, BLOCK_N)
        k = tl.load(KNew + rows[:, None] * stride_kn_tok + kv_head * stride_kn_head + d[None, :],
                    mask=d_mask[None, :], other=0.0)  # fmt: skip
        v = tl.load(VNew + rows[:, None] * stride_vn_tok + kv_head * stride_vn_head + d[None, :],
                    mask=d_mask[None, :], other=0.0)  # fmt: skip
        acc, m_i, l_i = _attend_block(q, k, v, acc, m_i, l_i, d_mask[None, :], sm_scale, False, PRECISION)
    for block_start in range(unmasked_end, new_end, BLOCK_N):
        j = block_start + tl.arange(0, BLOCK_N)
        j_mask = j < new_end
        kv_mask = j_mask[:, None] & d_mask[None, :]
        k = tl.load(KNew + (q_start + j)[:, None] * stride_kn_tok + kv_head * stride_kn_head + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        v = tl.load(VNew + (q_start + j)[:, None] * stride_vn_tok + kv_head * stride_vn_head + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        visible = (j[None, :] <= m[:, None]) & j_mask[None, :]
        acc, m_i, l_i = _attend_block(q, k, v, acc, m_i, l_i, visible, sm_scale, True, PRECISION)

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
) -> None:
    """out[b] = attention of q[b] `[bs, heads, head_dim]` over the first seq_lens[b] slots of row
    req_pool_indices[b]. No host synchronisation: safe to capture in a CUDA graph."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    # the scratch is allocated per call: inside a graph capture it comes from (and stays in) the graph's pool
    partial_out = torch.empty(bs, num_heads, NUM_KV_SPLITS, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(bs, num_heads, NUM_KV_SPLITS, dtype=torch.float32, device=q.device)
    width = block_d(head_dim)
    _decode_split_kernel[(bs, num_kv_heads, NUM_KV_SPLITS)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, partial_out, partial_lse, scaling,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(MIN_DOT_DIM, triton.next_power_of_2(group)),
        BLOCK_D=width, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=NUM_KV_SPLITS, PRECISION=_precision(q),
        num_warps=NUM_WARPS,
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
) -> None:
    """Causal attention of every sequence's new tokens (rows q_starts[i] .. + new_lens[i] of q
    `[tokens, heads, head_dim]`) over its prefix_lens[i] cached tokens, read from the pool through
    req_to_token, and its new ones, whose keys and values are the same rows of k_new/v_new
    `[tokens, kv_heads, head_dim]`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    width = block_d(head_dim)
    tiles = tiles or default_extend_tiles(width, q.dtype)
    grid = (new_lens.shape[0], num_heads, triton.cdiv(max_new_tokens, tiles.block_m))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, k_new, v_new, out, req_to_token, req_pool_indices, q_starts, new_lens, prefix_lens,
        scaling, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), out.stride(0),
        out.stride(1), req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=width, PRECISION=_precision(q), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
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
