"""`--quantization gguf_int8`: int8 weights made from a GGUF's blocks at load (gguf_int8.py).

- Each block type's weight becomes, to the bit, `quantize_per_channel` of gguf-py's own dequantization of
  the blocks (numpy, the independent reference), whole and as a fused layer's parts, in chunks of rows.
- The measured rule picks int8 for a file up to INT8_FROM_BLOCKS_MAX_PARAMS parameters and the blocks above
  it; `--quantization` forces either; neither is offered for a directory or a GPU.
- End to end on the embedded SmolLM2: greedy tokens against transformers on the dequantized fp32 weights,
  teacher-forced, flips only at a near-tie of stated size.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from srt.model_executor import gguf_int8, model_loader
from srt.model_executor.gguf_int8 import (
    INT8_FROM_BLOCKS_MAX_PARAMS,
    BlockInstaller,
    gguf_method,
    int8_from_blocks,
)
from srt.model_executor.layers import int8_linear
from srt.model_executor.layers.int8_math import int8_products, quantize_per_channel
from srt.model_executor.layers.linear_method import WEIGHT, W8A8Int8LinearMethod
from srt.model_executor.quantization import resolve_quantization
from test.unit.test_gguf_kernels import FLOATS, QUANTIZED, matrix
from test.unit.test_gguf_loader import embedded, resolve_model_dir
from test.unit.test_gguf_loader import (
    test_greedy_tokens_on_the_blocks_match_transformers_on_the_dequantized_weights as greedy_tokens_match_the_dequantized_reference,
)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")

SMOLLM2 = "smollm2-135m-instruct"


def reference_int8(reference: np.ndarray):
    return quantize_per_channel(torch.from_numpy(reference))


@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: t.name)
def test_int8_from_blocks_is_quantize_per_channel_of_gguf_py_dequantize(qtype):
    m, reference = matrix(qtype)
    got, want = int8_from_blocks([m]), reference_int8(reference)
    assert got.weight.dtype == torch.int8 and got.weight.shape == (m.rows, m.cols)
    assert torch.equal(got.weight, want.weight)
    assert torch.equal(got.scale, want.scale)


def test_a_fused_layer_in_chunks_of_rows_is_its_parts_quantized_one_by_one(monkeypatch):
    """q/k/v-like parts of their own types stack along the output, and a chunk smaller than a part (a few
    rows at a time) changes no bit: every row is quantized on its own."""
    parts = [matrix(T.Q4_K, rows=7, cols=512, seed=1), matrix(T.Q6_K, rows=5, cols=512, seed=2)]
    parts.append(matrix(T.Q8_0, rows=9, cols=512, seed=3))
    monkeypatch.setattr(gguf_int8, "DEQUANTIZE_CHUNK_VALUES", 3 * 512)  # three rows a chunk
    got = int8_from_blocks([m for m, _ in parts])
    want = reference_int8(np.concatenate([r for _, r in parts]))
    assert torch.equal(got.weight, want.weight) and torch.equal(got.scale, want.scale)


def file_of(parameters: int, matrix_type: T = T.Q4_K) -> SimpleNamespace:
    """What the rule reads of a GGUFFile: its tensors' types and shapes (a weight matrix of `matrix_type`
    holding all but 1,000 parameters, an F32 norm the rest)."""
    matrix = SimpleNamespace(ggml_type=int(matrix_type), shape=(parameters - 1000, 1))
    norm = SimpleNamespace(ggml_type=int(T.F32), shape=(1000,))
    return SimpleNamespace(tensors={"w": matrix, "norm": norm})


def test_int8_from_blocks_is_prepared_for_the_kernels_as_calibrated_weights_are(monkeypatch):
    """BlockInstaller hands the weight to the int8 method's `install`, which prepares every int8 weight the
    same way (`int8_linear.pack_weight`): where oneDNN's packed kernel is chosen (forced here; it is exact
    on every CPU, only slow on some), the weight is packed, and its products are the plain weight's."""
    monkeypatch.setattr(int8_linear, "packed_kernel_available", lambda: True)
    m, _ = matrix(T.Q4_K, rows=24, cols=512)  # within PACKED_MAX_K: packed where the kernel is chosen
    layer = SimpleNamespace(
        method=W8A8Int8LinearMethod(), weight_keys=lambda: [WEIGHT], drop_dense_weights=lambda: None
    )
    installer = BlockInstaller()
    installer.install(layer, [m])
    got = layer.method.int8_weight(WEIGHT)
    assert got.packed is not None and installer.packed
    x = torch.randint(-63, 64, (5, m.cols), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    plain = int8_from_blocks([m]).weight
    assert torch.equal(int8_products(x, got), torch._int_mm(x, plain.t()))  # noqa: SLF001 (no public name)


def test_the_rule_picks_int8_up_to_its_measured_size_and_the_blocks_above():
    assert gguf_method(file_of(INT8_FROM_BLOCKS_MAX_PARAMS)) == "gguf_int8"
    assert gguf_method(file_of(INT8_FROM_BLOCKS_MAX_PARAMS + 1)) == "gguf"
    # the files the rule was measured on: the embedded models on one side, a 1.1B Llama on the other
    assert gguf_method(file_of(134_515_008, T.Q4_1)) == "gguf_int8"  # SmolLM2-135M
    assert gguf_method(file_of(268_098_176, T.Q6_K)) == "gguf_int8"  # Gemma 3 270M
    assert gguf_method(file_of(1_170_302_976)) == "gguf"  # TinyLlama-1.1B's shape


@pytest.mark.parametrize("float_type", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_a_file_with_a_float_weight_matrix_keeps_its_blocks_at_any_size(float_type):
    assert gguf_method(file_of(1_000_000, float_type)) == "gguf"


def test_the_flag_forces_either_method_on_a_gguf_and_neither_elsewhere():
    path = embedded(SMOLLM2)
    for requested in ("gguf", "gguf_int8"):
        checkpoint, quantization = model_loader.open_checkpoint(path, requested, "cpu")
        assert quantization == checkpoint.quantization == requested
    checkpoint, quantization = model_loader.open_checkpoint(path, None, "cpu")
    assert quantization == gguf_method(checkpoint.file) == "gguf_int8"  # SmolLM2 is under the rule's size
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("gguf_int8", "cuda:0", gguf=True)
    with pytest.raises(ValueError, match="directory"):
        resolve_quantization("gguf_int8", "cpu")


@pytest.fixture(scope="module")
def runner():
    from srt.model_executor.model_runner import ModelRunner

    path = embedded(SMOLLM2)
    return ModelRunner(path, quantization="gguf_int8", max_total_tokens=4096, max_running_requests=8)


def test_every_linear_layer_holds_int8_and_the_embedding_stays_blocks(runner):
    """The head too (made from the tied embedding's blocks, which lookups keep reading)."""
    from srt.model_executor.layers.block_embedding import BlockEmbedding

    model = runner.model
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    layers = [model.lm_head] + [
        layer.get_submodule(name)
        for layer in model.model.layers
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]
    for layer in layers:
        assert isinstance(layer.method, W8A8Int8LinearMethod)
    weights = [layer.method.int8_weight(WEIGHT) for layer in layers]
    # prepared for the kernels as calibrated weights are (test_int8_linear's end-to-end check)
    assert all((w.packed is not None) == int8_linear.packed_kernel_available() for w in weights)
    assert all(w.weight.dtype == torch.int8 for w in weights if w.weight is not None)
    assert model.cpu_decode is not None  # the fused decode step runs it as it runs calibrated int8


def test_greedy_tokens_on_int8_from_blocks_match_transformers_on_the_dequantized_weights(runner):
    """test_gguf_loader's check of the blocks, on int8 made from them: every greedy token is transformers'
    top token on the dequantized fp32 weights given the same context (teacher-forced), or within its
    NEAR_TIE (1.5) of it, with at most its MAX_FLIPS (8) such flips. Measured: 2 flips of 72 steps, at
    leads 0.368 and 0.188 (the blocks: 5, at 0.007-0.165), so the blocks' bound holds with room."""
    greedy_tokens_match_the_dequantized_reference((runner, resolve_model_dir(SMOLLM2)))
