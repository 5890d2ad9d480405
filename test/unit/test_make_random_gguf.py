"""scripts/gguf_encode.py's K-quant encoders round-trip through gguf-py's decoder within half a step, and
scripts/make_random_gguf.py writes llama files in llama.cpp's type mixes that both readers accept."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.constants import QK_K

from srt.model_executor.gguf_file import GGUFFile

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def hard_rows(rng: np.random.Generator) -> np.ndarray:
    """Weights plus the blocks an encoder gets wrong: all zero, all positive, all negative, one sub-block
    a hundred times larger than its neighbours, a constant."""
    x = (rng.standard_normal((16, 4 * QK_K)) * 0.02).astype(np.float32)
    x[0, :QK_K] = 0
    x[1, :QK_K] = np.abs(x[1, :QK_K]) + 0.3
    x[2, :QK_K] = -np.abs(x[2, :QK_K]) - 0.3
    x[3, :32] *= 100
    x[4, :QK_K] = 0.7
    return x


def affine_bound(x: np.ndarray, levels: int) -> np.ndarray:
    """Per super-block, half a step of its widest 32-value sub-block (range including zero, which the
    subtracted min must reach) over `levels` steps, with the 6-bit scales' and fp16's rounding up."""
    sub = x.reshape(-1, QK_K // 32, 32)
    widest = (sub.max(-1) - np.minimum(sub.min(-1), 0)).max(-1)
    return 0.55 * widest / levels


def symmetric_bound(x: np.ndarray) -> np.ndarray:
    """Q6_K: values -32..31 times a per-16 int8 scale: half a step of the largest magnitude's sub-block."""
    return 0.51 * np.abs(x.reshape(-1, QK_K)).max(-1) / 31


@pytest.mark.parametrize(
    "qtype,bound",
    [
        (T.Q4_K, lambda x: affine_bound(x, 15)),
        (T.Q5_K, lambda x: affine_bound(x, 31)),
        (T.Q6_K, symmetric_bound),
    ],
    ids=["Q4_K", "Q5_K", "Q6_K"],
)
def test_a_k_quant_encoding_decodes_within_half_a_step(qtype, bound):
    x = hard_rows(np.random.default_rng(0))
    encoded = script("gguf_encode").encode(x, qtype)
    assert encoded.dtype == np.uint8
    assert encoded.shape == gguf.quants.quant_shape_to_byte_shape(x.shape, qtype)
    decoded = gguf.quants.dequantize(encoded, qtype)
    error = np.abs(decoded - x).reshape(-1, QK_K).max(-1)
    limit = bound(x)
    assert (error <= limit + 1e-7).all(), f"blocks over the bound: {np.flatnonzero(error > limit + 1e-7)}"
    assert (decoded.reshape(-1, QK_K)[0] == 0).all()  # an all-zero block stays exactly zero


def test_the_encoder_hands_the_32_value_types_to_gguf_py():
    x = hard_rows(np.random.default_rng(1))
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        assert np.array_equal(script("gguf_encode").encode(x, qtype), gguf.quants.quantize(x, qtype))


def test_rows_of_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        script("gguf_encode").encode(np.zeros((2, 576), np.float32), T.Q4_K)


def types_of(preset: str, mix: str) -> dict[str, T]:
    m = script("make_random_gguf")
    return {s.name: s.qtype for s in m.plan(m.PRESETS[preset], m.MIXES[mix], vocab=49152)}


def test_q4_k_m_follows_llama_cpps_rule_at_tinyllamas_shape():
    types = types_of("tinyllama-1.1b", "q4_k_m")
    # use_more_bits(i, 22): the first two layers, the last three, and every third from layer 4
    more_bits = [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]
    assert [i for i in range(22) if types[f"blk.{i}.attn_v.weight"] == T.Q6_K] == more_bits
    assert [i for i in range(22) if types[f"blk.{i}.ffn_down.weight"] == T.Q6_K] == more_bits
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    assert {types[f"blk.{i}.{w}.weight"] for i in range(22) for w in ("attn_q", "attn_k", "ffn_up")} == {
        T.Q4_K
    }
    assert types["blk.0.attn_norm.weight"] == T.F32


def test_rows_that_are_not_whole_k_blocks_fall_back_as_llama_cpps_do():
    """SmolLM2's 576-wide rows: Q4_K -> Q5_0, Q6_K -> Q8_0, and the tied embedding (the output) Q8_0."""
    types = types_of("smollm2-135m", "q4_k_m")
    assert "output.weight" not in types and types["token_embd.weight"] == T.Q8_0
    assert types["blk.5.attn_q.weight"] == T.Q5_0
    assert types["blk.0.attn_v.weight"] == T.Q8_0  # Q6_K by use_more_bits, 576 columns
    assert types["blk.0.ffn_down.weight"] == T.Q6_K  # 1536 columns: whole blocks
    assert types_of("smollm2-135m", "q5_k_m")["blk.5.attn_q.weight"] == T.Q5_1


def test_every_mix_of_the_tiny_preset_has_its_block_type():
    for mix, qtype in {
        "q4_0": T.Q4_0,
        "q4_1": T.Q4_1,
        "q8_0": T.Q8_0,
        "q5_k_m": T.Q5_K,
        "q6_k": T.Q6_K,
    }.items():
        assert types_of("tiny", mix)["blk.0.attn_q.weight"] == qtype, mix
    assert {T.Q4_K, T.Q6_K} <= set(types_of("tiny", "q4_k_m").values())


SEED = 3  # every mix from the same weights (each tensor's generator is seeded by SEED and its index)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """mix -> (path, specs) of the tiny preset, each written on first use."""
    folder = tmp_path_factory.mktemp("random")
    files = {}

    def get(mix: str):
        if mix not in files:
            path = folder / f"tiny-{mix}.gguf"
            files[mix] = path, script("make_random_gguf").write_random_gguf(str(path), "tiny", mix, seed=SEED)
        return files[mix]

    return get


@pytest.fixture(scope="module")
def tiny_file(tiny_files):
    return tiny_files("q4_k_m")


def test_a_random_file_has_llama_keys_and_smollm2s_tokenizer(tiny_file):
    from srt.model_source import default_gguf_path

    path, specs = tiny_file
    f = GGUFFile.open(str(path))
    shape = script("make_random_gguf").PRESETS["tiny"]
    md = f.metadata
    assert (
        md["general.architecture"] == "llama" and md["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    )
    assert (md["llama.block_count"], md["llama.embedding_length"]) == (shape.layers, shape.hidden)
    assert (md["llama.attention.head_count"], md["llama.attention.head_count_kv"]) == (
        shape.heads,
        shape.kv_heads,
    )
    assert md["llama.feed_forward_length"] == shape.intermediate
    smollm2 = GGUFFile.open(default_gguf_path()).metadata
    assert {k: v for k, v in md.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in smollm2.items() if k.startswith("tokenizer.")
    }
    assert md["llama.vocab_size"] == len(md["tokenizer.ggml.tokens"]) == 49152
    assert [(t.name, t.ggml_type, t.shape) for t in f.tensors.values()] == [
        (s.name, s.qtype, s.shape) for s in specs
    ]


def test_a_random_file_decodes_to_weights_of_the_asked_spread(tiny_file):
    path, _ = tiny_file
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        if len(t.shape) == 1:
            assert (values == 1).all(), t.name
        else:
            assert abs(values.std() - 0.02) < 0.002, (t.name, values.std())


def test_llama_cpp_runs_the_k_quant_files_as_close_to_q8_0_as_gguf_pys_own_encodings(tiny_files):
    """An independent decoder: llama.cpp's logits for a prompt on each mix of the same weights, against the
    Q8_0 file's. Q4_K_M is at least as close as gguf-py's Q4_0, and more bits are closer (Q6_K > Q5_K_M >
    Q4_K_M): a mis-packed scale or nibble would put a K-quant file far off."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the peers extra) is not installed")

    def logits(mix: str) -> np.ndarray:
        llm = llama_cpp.Llama(str(tiny_files(mix)[0]), n_ctx=128, verbose=False, logits_all=True)
        tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog")
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)])

    reference = logits("q8_0")

    def closeness(mix: str) -> float:
        x = logits(mix)
        return float(
            ((x * reference).sum(-1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(reference, axis=-1)).min()
        )

    q4_0, q4_k_m, q5_k_m, q6_k = (closeness(m) for m in ("q4_0", "q4_k_m", "q5_k_m", "q6_k"))
    assert q4_0 > 0.9  # the reference itself is sound: same weights, another 4-bit encoding
    assert q4_k_m >= q4_0 - 0.002 and q4_k_m < q5_k_m < q6_k, (q4_0, q4_k_m, q5_k_m, q6_k)
