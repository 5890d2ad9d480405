"""Random-weight GGUFs of real Llama shapes, for the scale ladder (scripts/bench_scale.py) and the tests.

A file has llama architecture keys, the embedded SmolLM2's tokenizer metadata (so its vocabulary is 49152
tokens and srt's and llama.cpp's servers tokenize alike) and its weights in one of llama.cpp's type mixes,
chosen per tensor by llama.cpp's rule (`llama_tensor_get_type`, read for the facts): the output matrix (or,
tied, the embedding) Q6_K; in Q4_K_M/Q5_K_M files attn_v and ffn_down Q6_K in the layers `use_more_bits`
picks; rows that are not whole K-quant blocks (256) fall back as llama.cpp's do (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0); norms F32. gguf-py encodes the 32-value types, scripts/gguf_encode.py the
K-quants. The file is streamed tensor by tensor, each generated in row chunks, so memory stays at one
quantized tensor (a 7B file is ~4 GB).

    python scripts/make_random_gguf.py /tmp/tinyllama-q4_k_m.gguf --preset tinyllama-1.1b --mix q4_k_m
    python scripts/make_random_gguf.py /tmp/tiny-q6_k.gguf --preset tiny --mix q6_k

Weights are uniform with std `--std` (0.02, a usual init): the values are random; the shapes, the block
formats and the bytes per token are a real model's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_encode import encode  # noqa: E402  (a sibling script module)

T = GGMLQuantizationType
DEFAULT_STD = 0.02
CHUNK_VALUES = 1 << 24  # float32 values generated and encoded at a time (64 MB)
QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION, which llama.cpp writes
TOKENIZER_PREFIX = "tokenizer."


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied: bool = False  # no output matrix: the embedding is the LM head (SmolLM2)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS = {
    # the tests' model: the smallest hidden size whose rows are whole K-quant blocks (256), so every mix
    # has Q4_K/Q5_K/Q6_K tensors (with 64, every K-quant tensor would fall back to a 32-value type)
    "tiny": ModelShape(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512),
    "smollm2-135m": ModelShape(30, 576, 9, 3, 1536, context=8192, rope_theta=100000.0, tied=True),
    "tinyllama-1.1b": ModelShape(22, 2048, 32, 4, 5632),
    "llama2-7b": ModelShape(32, 4096, 32, 32, 11008, context=4096),
}


@dataclass(frozen=True)
class TypeMix:
    base: T  # most weight matrices
    file_type: LlamaFileType
    more_bits: T | None = None  # attn_v / ffn_down in the layers use_more_bits picks (the *_K_M mixes)


MIXES = {
    "q4_0": TypeMix(T.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": TypeMix(T.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q8_0": TypeMix(T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_k_m": TypeMix(T.Q4_K, LlamaFileType.MOSTLY_Q4_K_M, T.Q6_K),
    "q5_k_m": TypeMix(T.Q5_K, LlamaFileType.MOSTLY_Q5_K_M, T.Q6_K),
    "q6_k": TypeMix(T.Q6_K, LlamaFileType.MOSTLY_Q6_K),
}
# llama.cpp's types for rows that are not whole blocks of the chosen one
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order: (out_features, in_features)
    qtype: T


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits: the first and last eighth
    and every third in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, cols: int, layer: int, shape: ModelShape, mix: TypeMix) -> T:
    qtype = mix.base
    if name == "output.weight" or (shape.tied and name == "token_embd.weight"):
        if cols % GGML_QUANT_SIZES[qtype][0]:
            qtype = T.Q8_0
        elif qtype != T.Q8_0:
            qtype = T.Q6_K
    elif mix.more_bits is not None and name.endswith(("attn_v.weight", "ffn_down.weight")):
        if use_more_bits(layer, shape.layers):
            qtype = mix.more_bits
    if cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = FALLBACK[qtype]
        if cols % GGML_QUANT_SIZES[qtype][0]:
            qtype = T.F16
    return qtype


def plan(shape: ModelShape, mix: TypeMix, vocab: int, embedding_rows: int | None = None) -> list[TensorSpec]:
    """Every tensor of a llama model, in file order. `embedding_rows` (default: `vocab`) lets a test craft
    an embedding that disagrees with the vocabulary."""
    rows = embedding_rows or vocab
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim

    def weight(name: str, out: int, inp: int, layer: int = 0) -> TensorSpec:
        return TensorSpec(name, (out, inp), tensor_type(name, inp, layer, shape, mix))

    specs = [weight("token_embd.weight", rows, h)]
    for i in range(shape.layers):
        p = f"blk.{i}."
        specs += [
            TensorSpec(p + "attn_norm.weight", (h,), T.F32),
            weight(p + "attn_q.weight", h, h, i),
            weight(p + "attn_k.weight", kv, h, i),
            weight(p + "attn_v.weight", kv, h, i),
            weight(p + "attn_output.weight", h, h, i),
            TensorSpec(p + "ffn_norm.weight", (h,), T.F32),
            weight(p + "ffn_gate.weight", shape.intermediate, h, i),
            weight(p + "ffn_up.weight", shape.intermediate, h, i),
            weight(p + "ffn_down.weight", h, shape.intermediate, i),
        ]
    specs.append(TensorSpec("output_norm.weight", (h,), T.F32))
    if not shape.tied:
        specs.append(weight("output.weight", rows, h))
    return specs


def nbytes(spec: TensorSpec) -> int:
    block_size, type_size = GGML_QUANT_SIZES[spec.qtype]
    return int(np.prod(spec.shape)) // block_size * type_size


def random_tensor(spec: TensorSpec, rng: np.random.Generator, std: float) -> np.ndarray:
    """The tensor's bytes: norms are ones; a matrix is uniform with `std`, encoded CHUNK_VALUES at a time."""
    if len(spec.shape) == 1:
        return np.ones(spec.shape, dtype=np.float32)
    rows, cols = spec.shape
    block_size, type_size = GGML_QUANT_SIZES[spec.qtype]
    out = np.empty((rows, cols // block_size * type_size), dtype=np.uint8)
    half_width = std * np.sqrt(3.0, dtype=np.float32)  # uniform on [-a, a] has std a / sqrt(3)
    step = max(1, CHUNK_VALUES // cols)
    for r in range(0, rows, step):
        x = rng.random((min(step, rows - r), cols), dtype=np.float32)
        x -= 0.5
        x *= 2 * half_width
        out[r : r + len(x)] = encode(x, spec.qtype)
    return out


def tokenizer_metadata(gguf_path: str | None) -> dict[str, object]:
    """The `tokenizer.*` keys of a GGUF (default: the embedded SmolLM2's)."""
    from srt.model_executor.gguf_file import GGUFFile
    from srt.model_source import default_gguf_path

    metadata = GGUFFile.open(gguf_path or default_gguf_path()).metadata
    return {k: v for k, v in metadata.items() if k.startswith(TOKENIZER_PREFIX)}


def add_value(w: GGUFWriter, key: str, value: object) -> None:
    """A copied key with its usual GGUF type (ids uint32, token types int32, scores float32)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_key_value(key, value, *_gguf_type(value))


def _gguf_type(value: object):
    from gguf import GGUFValueType

    if isinstance(value, str):
        return (GGUFValueType.STRING,)
    return GGUFValueType.ARRAY, GGUFValueType.get_type(value[0])


def write_random_gguf(
    path: str,
    preset: str,
    mix_name: str,
    seed: int = 0,
    std: float = DEFAULT_STD,
    tokenizer_gguf: str | None = None,
    embedding_rows: int | None = None,
) -> list[TensorSpec]:
    """Writes the file (through a temporary name, so a half-written file never has `path`'s name)."""
    shape, mix = PRESETS[preset], MIXES[mix_name]
    tokenizer = tokenizer_metadata(tokenizer_gguf)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    specs = plan(shape, mix, vocab, embedding_rows)
    tmp = f"{path}.tmp{os.getpid()}"
    w = GGUFWriter(tmp, "llama")
    w.add_name(f"random {preset} {mix_name}")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_vocab_size(vocab)
    w.add_file_type(mix.file_type)
    w.add_quantization_version(QUANTIZATION_VERSION)
    for key, value in tokenizer.items():
        add_value(w, key, value)
    for spec in specs:
        w.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), nbytes(spec), raw_dtype=spec.qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, spec in enumerate(specs):
            w.write_tensor_data(random_tensor(spec, np.random.default_rng([seed, i]), std))
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("output", help="the .gguf file to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--mix", choices=sorted(MIXES), default="q4_k_m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=DEFAULT_STD, help="standard deviation of the weights")
    parser.add_argument(
        "--tokenizer-gguf", help="copy the tokenizer from this GGUF (default: embedded SmolLM2)"
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    specs = write_random_gguf(args.output, args.preset, args.mix, args.seed, args.std, args.tokenizer_gguf)
    counts: dict[str, int] = {}
    for spec in specs:
        counts[spec.qtype.name] = counts.get(spec.qtype.name, 0) + 1
    mix = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
    size = os.path.getsize(args.output)
    print(
        f"wrote {args.output}: {size / 2**20:.1f} MiB, {len(specs)} tensors ({mix}) in {time.monotonic() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
