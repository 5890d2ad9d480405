"""Host side of the Triton paged-attention kernels (`triton_kernels.py`): launch shapes, argument checks
and the launches themselves, kept apart so the kernel module holds only device code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from srt.model_executor.attention.triton_kernels import (
    decode_merge_kernel,
    decode_split_kernel,
    extend_kernel,
)
from srt.model_executor.attention.window_cap import window_and_cap_args

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


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for operands of `dtype`: fp32 exactly (not tf32), so an fp32 model computes
    as precisely as the PyTorch reference; "tf32" is ignored for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


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
    window, cap = window_and_cap_args(sliding_window, logit_cap, "the triton attention kernels")
    decode_split_kernel[(bs, num_kv_heads, NUM_KV_SPLITS)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, partial_out, partial_lse, scaling,
        window, cap, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(MIN_DOT_DIM, triton.next_power_of_2(group)),
        BLOCK_D=width, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=NUM_KV_SPLITS, WINDOWED=sliding_window is not None,
        CAPPED=logit_cap is not None, PRECISION=dot_precision(q.dtype), num_warps=NUM_WARPS,
    )  # fmt: skip
    decode_merge_kernel[(bs, num_heads)](
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
    window, cap = window_and_cap_args(sliding_window, logit_cap, "the triton attention kernels")
    extend_kernel[grid](
        q, k_buffer, v_buffer, k_new, v_new, out, req_to_token, req_pool_indices, q_starts, new_lens, prefix_lens,
        scaling, window, cap, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=width, WINDOWED=sliding_window is not None, CAPPED=logit_cap is not None,
        PRECISION=dot_precision(q.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
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
