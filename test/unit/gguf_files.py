"""Tiny random-weight GGUF files for tests: a Llama of small shape whose layers are stored in the block types
a test asks for, with the embedded SmolLM2's tokenizer (so its prompts and chat template are real).

gguf-py quantizes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 itself; it only decodes the K-quants, so a K-quant tensor is random
bytes with its fp16 super-block scales rescaled to the weight scale asked for: any bytes are a valid
encoding once the scales are finite, and the reference decodes the same bytes with gguf-py's `dequantize`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from srt.model_executor.gguf_file import GGUFFile

# Small but GQA (4 query heads per 2 KV heads) and wide enough for the K-quants' 256-value super-blocks.
SHAPE = dict(hidden=256, heads=4, kv_heads=2, inter=512, context=2048)
# Small enough that the kernels' int8 activation rounding is not amplified through the layers (at 0.1 one
# position in 64 moved by the logits' whole range against exact activations; at 0.03, 0.06 of a 2.3 range).
WEIGHT_STD = 0.03
GGUF_PY_QUANTIZES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# byte offsets of the fp16 scale(s) in a K-quant block that scale every value of it
K_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
# Q4_K's and Q5_K's packed 6-bit sub-block scales and mins (bytes 4-15), set so that every value is
# d * (2q - 15) (Q4_K, q 0..15) or d * (2q - 31) (Q5_K, q 0..31): zero-mean weights. Random bytes there
# give every block an offset, and a layer whose rows share an offset cancels its inputs' mean so sharply
# that int8 activation rounding is amplified ~15x (a wrong-looking token on a sound kernel).
K_SUBBLOCK_SCALES = {
    T.Q4_K: bytes([2] * 4 + [15] * 4 + [2 | 15 << 4] * 4),  # scale 2, min 15
    T.Q5_K: bytes([2] * 4 + [31 | 1 << 6] * 4 + [2 | 15 << 4] * 4),  # scale 2, min 31
}
TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def encode(rng: np.random.Generator, rows: int, cols: int, qtype: T) -> np.ndarray:
    """A [rows, cols] weight of about WEIGHT_STD in `qtype`'s encoding (uint8 [rows, row_bytes], or the
    float array itself for F32/F16)."""
    if qtype in (T.F32, T.F16):
        return (rng.standard_normal((rows, cols)) * WEIGHT_STD).astype(
            np.float32 if qtype == T.F32 else np.float16
        )
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in GGUF_PY_QUANTIZES:
        return quantize((rng.standard_normal((rows, cols)) * WEIGHT_STD).astype(np.float32), qtype)
    if qtype not in K_SCALE_OFFSETS:  # a type srt refuses: bytes of the right size, never decoded
        return rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    if qtype in K_SUBBLOCK_SCALES:
        blocks[:, 4:16] = np.frombuffer(K_SUBBLOCK_SCALES[qtype], np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        blocks[:, offset : offset + 2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    std = float(dequantize(blocks, qtype).std())
    scale = np.frombuffer(np.float16(WEIGHT_STD / std).tobytes(), np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        blocks[:, offset : offset + 2] = scale
    return blocks.reshape(rows, -1)


def write_random_llama(
    path: Path,
    tokenizer_gguf: str,
    layer_types: list[T],
    seed: int = 0,
    head_type: T | None = T.Q6_K,
    rope: tuple[float, np.ndarray | None] = (10000.0, None),
) -> str:
    """A llama GGUF with one decoder layer per entry of `layer_types` (all its linear tensors in that
    type), a Q8_0 embedding, and an untied `output.weight` in `head_type` (None: tied to the embedding).
    `rope`: the base and, if not None, a `rope_freqs` tensor (a divisor per frequency, as Llama 3.1's)."""
    rng = np.random.default_rng(seed)
    meta = GGUFFile.open(tokenizer_gguf).metadata
    vocab = len(meta["tokenizer.ggml.tokens"])
    h, heads, kv_heads, inter = SHAPE["hidden"], SHAPE["heads"], SHAPE["kv_heads"], SHAPE["inter"]
    head_dim = h // heads
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(SHAPE["context"])
    w.add_embedding_length(h)
    w.add_block_count(len(layer_types))
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope[0])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    for key in TOKENIZER_KEYS:
        if key in meta:
            _add(w, key, meta[key])

    def tensor(name: str, rows: int, cols: int, qtype: T) -> None:
        data = encode(rng, rows, cols, qtype)
        raw = None if qtype in (T.F32, T.F16) else qtype
        w.add_tensor(name, data, raw_dtype=raw)

    tensor("token_embd.weight", vocab, h, T.Q8_0)
    if head_type is not None:
        tensor("output.weight", vocab, h, head_type)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    if rope[1] is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope[1], dtype=np.float32))
    for i, qtype in enumerate(layer_types):
        for name, rows, cols in (
            ("attn_q", heads * head_dim, h),
            ("attn_k", kv_heads * head_dim, h),
            ("attn_v", kv_heads * head_dim, h),
            ("attn_output", h, heads * head_dim),
            ("ffn_gate", inter, h),
            ("ffn_up", inter, h),
            ("ffn_down", h, inter),
        ):
            tensor(f"blk.{i}.{name}.weight", rows, cols, qtype)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _add(w: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list) and value and isinstance(value[0], str):
        w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.STRING)
    else:
        w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
