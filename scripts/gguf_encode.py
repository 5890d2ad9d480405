"""Numpy encoders for ggml's K-quant blocks (Q4_K, Q5_K, Q6_K), which gguf-py can decode but not encode.

Test files and kernel tests need K-quant data; any valid encoding is a valid file, so these are the simple
ones, not llama.cpp's error-minimising search: per 32-value sub-block (16 for Q6_K) a scale (and for Q4_K/
Q5_K a min) from the sub-block's range, quantized to 6 bits (Q6_K: 8) against the block's fp16 super-scales,
each rounded *up* so that every value stays inside the quantized range and is only ever rounded to the
nearest level, never clipped: a value's error is at most half its sub-block's step. Block layouts are
ggml's (`block_q4_K`, `block_q5_K`, `block_q6_K`), as gguf-py's `quants.py` decodes them.

`encode` takes float32 rows and returns uint8 rows of whole blocks, like `gguf.quants.quantize`, to which
it hands every other type. Imports nothing from srt: scripts and tests use it alike.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

K_SCALE_BITS = 6  # Q4_K/Q5_K sub-block scales and mins are 6-bit
Q6_K_SCALE_MAX = 127  # Q6_K sub-block scales are int8


def encode(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [..., cols] -> uint8 [..., cols / block_size * type_size] in `qtype`'s blocks."""
    encoder = _K_ENCODERS.get(qtype)
    if encoder is None:
        import gguf.quants

        return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qtype).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if x.shape[-1] % block_size:
        raise ValueError(f"rows of {x.shape[-1]} values are not whole {qtype.name} blocks of {block_size}")
    if not np.isfinite(x).all():
        raise ValueError("cannot encode non-finite values")
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK_K)
    out = encoder(blocks)
    assert out.shape == (blocks.shape[0], type_size)
    return out.reshape(*x.shape[:-1], x.shape[-1] // block_size * type_size)


def _fp16_at_least(v: np.ndarray) -> np.ndarray:
    """v rounded to fp16, upward: a scale never shrinks below what its sub-blocks need."""
    h = v.astype(np.float16)
    low = h.astype(np.float32) < v
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _levels(need: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """Per sub-block, the smallest integer multiple of the block's `unit` that covers `need` (0..top)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(unit > 0, np.ceil(need / unit), 0)
    return np.clip(q, 0, top).astype(np.uint8)


def _quantize(x: np.ndarray, step: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """round(x / step) clipped to lo..hi (0 where the step is 0)."""
    q = x * np.divide(1.0, step, out=np.zeros_like(step), where=step > 0)
    np.rint(q, out=q)
    return np.clip(q, lo, hi, out=q)


def _affine_sub_blocks(blocks: np.ndarray, max_q: int):
    """The shared part of Q4_K and Q5_K: value = d * sc_j * q - dmin * m_j per 32-value sub-block j, q in
    0..max_q. Returns (d fp16 [n], dmin fp16 [n], sc [n, 8], m [n, 8], q uint8 [n, 8, 32])."""
    sub = blocks.reshape(-1, QK_K // 32, 32)
    top = (1 << K_SCALE_BITS) - 1
    offset_needed = -np.minimum(sub.min(axis=-1), 0)  # m_j >= 0: the min is subtracted
    dmin = _fp16_at_least(offset_needed.max(axis=-1) / top)
    m = _levels(offset_needed, dmin.astype(np.float32)[:, None], top)
    offset = dmin.astype(np.float32)[:, None] * m
    scale_needed = (sub.max(axis=-1) + offset) / max_q  # covers [-offset, max] in max_q steps
    d = _fp16_at_least(scale_needed.max(axis=-1) / top)
    sc = _levels(scale_needed, d.astype(np.float32)[:, None], top)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = _quantize(sub + offset[..., None], step, 0, max_q).astype(np.uint8)
    return d, dmin, sc, m, q


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> ggml's 12 bytes: bytes 0-3 and 4-7 hold sub-blocks 0-3's scale and min
    plus, in their top two bits, the high bits of sub-blocks 4-7's; bytes 8-11 hold 4-7's low nibbles."""
    lo_sc, hi_sc, lo_m, hi_m = sc[:, :4], sc[:, 4:], m[:, :4], m[:, 4:]
    return np.concatenate(
        [lo_sc | ((hi_sc >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_sc & 0xF) | ((hi_m & 0xF) << 4)], axis=-1
    ).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] values 0..15 -> [n, 128] bytes: chunk c holds sub-block 2c low, 2c+1 high."""
    pairs = q.reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _half_bytes(h: np.ndarray) -> np.ndarray:
    return h.view(np.uint8).reshape(-1, 2)


def encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_sub_blocks(blocks, 15)
    return np.concatenate([_half_bytes(d), _half_bytes(dmin), _pack_k_scales(sc, m), _nibbles(q)], axis=-1)


def encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_sub_blocks(blocks, 31)
    # qh[l] bit j is the fifth bit of sub-block j's value l
    bits = (q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(bits, axis=1)
    return np.concatenate(
        [_half_bytes(d), _half_bytes(dmin), _pack_k_scales(sc, m), qh, _nibbles(q & 0xF)], axis=-1
    )


def encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """value = d * scale_j * (q - 32) per 16-value sub-block j, q in 0..63, scale_j an int8 (kept >= 0)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, QK_K // 16, 16)
    scale_needed = np.maximum(sub.max(axis=-1) / 31, -sub.min(axis=-1) / 32)  # q - 32 spans -32..31
    d = _fp16_at_least(scale_needed.max(axis=-1) / Q6_K_SCALE_MAX)
    scales = _levels(scale_needed, d.astype(np.float32)[:, None], Q6_K_SCALE_MAX)
    step = (d.astype(np.float32)[:, None] * scales)[..., None]
    q = (_quantize(sub, step, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, group, l]
    # within each 128-value half: groups 0/1 in the low nibbles of ql's two 32-byte runs, 2/3 in the high
    ql = np.concatenate(
        [q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], -1
    )
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), scales.view(np.uint8), _half_bytes(d)], axis=-1
    ).astype(np.uint8)


_K_ENCODERS = {
    GGMLQuantizationType.Q4_K: encode_q4_k,
    GGMLQuantizationType.Q5_K: encode_q5_k,
    GGMLQuantizationType.Q6_K: encode_q6_k,
}
