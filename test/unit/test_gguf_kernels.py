"""GGUF block formats in srt's C kernels (`cpu_gguf_kernels.c` through `gguf_linear.py`), against gguf-py's own
`gguf.quants.dequantize` (numpy) as the independent reference.

Tolerances. Rows are dequantized to the bit. A product quantizes the activations per block of 32 to int8
(ggml's Q8_0: d = amax / 127), so it is compared twice: with the dequantized weight times those very
activations (the kernel's arithmetic, up to fp32 summation order: RTOL_SAME_INPUTS of the sum of |terms|),
and with the exact fp32 product, which it may miss by the activation rounding, at most sum_i |w_i| * d_i / 2.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from srt.model_executor.layers import cpu_kernel_build, cpu_kernels, gguf_linear
from srt.model_executor.layers.gguf_linear import (
    BlockMatrix,
    UnsupportedBlockType,
    block_matmul,
    dequantize_rows,
)
from srt.model_executor.layers.linear import ColumnParallelLinear
from srt.model_executor.layers.linear_method import LINEAR_METHODS, WEIGHT, GGUFLinearMethod
from srt.model_executor.parallel_state import TensorParallelGroup

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")

QUANTIZED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
FLOATS = [T.F32, T.F16, T.BF16]
# fp32 sums in another order than numpy's: relative to the sum of the terms' magnitudes (a row of a few
# thousand terms in a few dozen partial sums rounds at ~1e-6 of it)
RTOL_SAME_INPUTS = 2e-5
# token counts: one, a partial tile, a full tile, and past one token block (TOKEN_BLOCK = 32 in the C source)
TOKENS = (1, 3, 4, 37)
# input sizes: one C chunk (COL_CHUNK = 2048) and a half vector; past a chunk with a half-vector tail
COLS = {
    T.Q4_0: 2080,
    T.Q4_1: 96,
    T.Q5_0: 2080,
    T.Q5_1: 2080,
    T.Q8_0: 2080,
    T.Q4_K: 2304,
    T.Q5_K: 512,
    T.Q6_K: 2304,
}
ROWS = 19


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: gguf-py's own quantization where it has one, else random bytes with finite
    fp16 scales (any bytes are a valid K-quant block)."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0) or qtype in FLOATS:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(values, qtype).view(np.uint8).reshape(rows, -1)
    elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // elements, nbytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, cols // elements, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:  # d last
        blocks[..., nbytes - 2 :] = scales[..., :2]
    else:  # d, dmin first
        blocks[..., :4] = scales
    return blocks.reshape(rows, -1)


def matrix(
    qtype: T, rows: int = ROWS, cols: int | None = None, seed: int = 0
) -> tuple[BlockMatrix, np.ndarray]:
    """(the block matrix, gguf's dequantization of it as fp32 [rows, cols])"""
    cols = cols or COLS.get(qtype, 160)
    raw = random_blocks(qtype, rows, cols, seed)
    reference = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    return BlockMatrix(int(qtype), rows, cols, torch.from_numpy(raw)), reference


def q8_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the activations as the kernels quantize them, their scale per input): Q8_0 per block of 32 in fp32"""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv)
    return (q * d).reshape(x.shape), np.repeat(d, 32, axis=-1).reshape(x.shape)


def assert_product(y: np.ndarray, w: np.ndarray, x: np.ndarray, quantized: bool) -> None:
    if quantized:
        xq, d = q8_activations(x)
        np.testing.assert_array_less(
            np.abs(y - xq @ w.T), RTOL_SAME_INPUTS * (np.abs(xq) @ np.abs(w).T) + 1e-6
        )
        bound = 0.5 * (d @ np.abs(w).T)  # sum_i |w_i| d_i / 2
        np.testing.assert_array_less(np.abs(y - x @ w.T), bound * (1 + 1e-3) + 1e-5)
    else:
        np.testing.assert_array_less(np.abs(y - x @ w.T), RTOL_SAME_INPUTS * (np.abs(x) @ np.abs(w).T) + 1e-6)


@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: t.name)
def test_dequantized_rows_are_gguf_dequantize_to_the_bit(qtype):
    m, reference = matrix(qtype)
    ids = torch.tensor([[5, 0], [ROWS - 1, 5]])
    rows = dequantize_rows(m, ids)
    assert rows.shape == (2, 2, m.cols) and rows.dtype == torch.float32
    assert np.array_equal(rows.numpy(), reference[ids.numpy()])


@pytest.mark.parametrize("qtype", QUANTIZED + FLOATS, ids=lambda t: t.name)
def test_block_matmul_is_the_dequantized_weight_times_the_activations(qtype):
    m, w = matrix(qtype)
    gen = torch.Generator().manual_seed(1)
    for tokens in TOKENS:
        x = torch.randn(tokens, m.cols, generator=gen) * 3
        y = block_matmul(x, m)
        assert y.shape == (tokens, ROWS) and y.dtype == torch.float32
        assert_product(y.numpy(), w, x.numpy(), quantized=qtype in QUANTIZED)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_exact_activations_give_the_fp32_product_of_the_dequantized_weight(qtype):
    m, w = matrix(qtype)
    x = torch.randn(5, m.cols, generator=torch.Generator().manual_seed(5)) * 3
    assert_product(block_matmul(x, m, exact=True).numpy(), w, x.numpy(), quantized=False)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_a_token_gets_the_same_bits_alone_and_in_a_batch(qtype):
    m, _ = matrix(qtype)
    x = torch.randn(37, m.cols, generator=torch.Generator().manual_seed(2))
    for exact in (False, True):
        batch = block_matmul(x, m, exact)
        for t in (0, 5, 36):
            assert torch.equal(block_matmul(x[t : t + 1], m, exact), batch[t : t + 1])


def test_strided_rows_and_activations_give_the_contiguous_result():
    m, _ = matrix(T.Q4_K, rows=2 * ROWS)
    every_other = BlockMatrix(m.qtype, ROWS, m.cols, m.data[::2])  # rows twice their size apart
    packed = BlockMatrix(m.qtype, ROWS, m.cols, m.data[::2].contiguous())
    wide = torch.randn(3, 2 * m.cols, generator=torch.Generator().manual_seed(3))
    x = wide[:, : m.cols]  # a row stride of 2 * cols
    assert torch.equal(block_matmul(x, every_other), block_matmul(x.contiguous(), packed))
    assert torch.equal(block_matmul(x.reshape(1, 3, -1), packed)[0], block_matmul(x, packed))


def test_tensor_parallel_shards_are_views_of_their_rows_and_block_columns():
    m, w = matrix(T.Q4_K, cols=1024)
    right = m.narrow(1, 512, 512)  # a row-parallel rank's input half: a strided view of the same bytes
    assert right.data.data_ptr() == m.data.data_ptr() + m.row_bytes // 2
    assert np.array_equal(dequantize_rows(right, torch.arange(ROWS)).numpy(), w[:, 512:])
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6))
    assert_product(block_matmul(x, right).numpy(), w[:, 512:], x.numpy(), quantized=True)
    rows = m.narrow(0, 4, 8)  # a column-parallel rank's outputs
    assert np.array_equal(dequantize_rows(rows, torch.arange(8)).numpy(), w[4:12])
    with pytest.raises(ValueError, match="256-element blocks"):
        m.narrow(1, 128, 512)
    with pytest.raises(ValueError, match="within it"):
        m.narrow(1, 768, 512)
    permuted = m.select_rows(torch.tensor([3, 0, 2]))
    assert np.array_equal(dequantize_rows(permuted, torch.arange(3)).numpy(), w[[3, 0, 2]])


def test_zero_and_non_finite_activation_blocks():
    m, w = matrix(T.Q8_0, cols=64)
    x = torch.zeros(3, 64)
    x[1, 40] = float("inf")  # the second block of token 1
    x[2, :32] = 1.0
    y = block_matmul(x, m)
    assert torch.equal(y[0], torch.zeros(ROWS))
    assert torch.isnan(y[1]).all()
    assert_product(y[2:].numpy(), w, x[2:].numpy(), quantized=True)


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> dict[str, gguf_linear.GGUFKernels]:
    """The library built as every variant this CPU can run (the native build is the one srt uses)."""
    flags_of = {"portable": "x86-64"}
    if " avx2 " in open("/proc/cpuinfo").read():
        flags_of["avx2"] = "x86-64-v3"
    mp = pytest.MonkeyPatch()
    mp.setenv("SRT_CACHE_DIR", str(tmp_path_factory.mktemp("gguf_variants")))
    built = {}
    for name, march in flags_of.items():
        flags = tuple(f"-march={march}" if f == "-march=native" else f for f in cpu_kernel_build.FLAGS)
        library = cpu_kernel_build.build(flags=flags, block_products=True)  # the products' build
        built[name] = gguf_linear.GGUFKernels(cpu_kernels.CpuKernels(library))
        assert built[name].isa == name
    mp.undo()
    return built


@pytest.mark.parametrize("qtype", QUANTIZED + [T.F16], ids=lambda t: t.name)
def test_every_isa_variant_agrees_with_the_native_one(variants, qtype):
    m, _ = matrix(qtype)
    x = torch.randn(5, m.cols, generator=torch.Generator().manual_seed(4))
    native = gguf_linear.kernels()
    expected, rows = native.matmul(x, [m]), native.dequantize_rows(m, torch.arange(ROWS))
    xq, _ = q8_activations(x.numpy()) if qtype in QUANTIZED else (x.numpy(), None)
    magnitude = np.abs(xq) @ np.abs(native.dequantize_rows(m, torch.arange(ROWS)).numpy()).T
    for name, k in variants.items():
        # the same integers and scales, summed in other orders: the same tolerance as against numpy
        np.testing.assert_array_less(
            (k.matmul(x, [m]) - expected).abs().numpy(), RTOL_SAME_INPUTS * magnitude + 1e-6
        )
        assert torch.equal(k.dequantize_rows(m, torch.arange(ROWS)), rows), name


def test_every_isa_variant_quantizes_activations_to_the_same_bytes(variants):
    """The activation rows (int8 values, scales, sums) are one definition, whatever the build computes them
    with: zero, non-finite, tiny and huge blocks, and values that round half-way."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9)) * 4
    x[0, :32] = 0.0
    x[0, 40] = float("nan")
    x[1, 70] = float("-inf")
    x[1, 96:128] = torch.arange(32) - 15.5  # with amax 127 the scale is 1: halves, rounded to even
    x[1, 127] = 127.0
    x[2, 128:160] *= 1e-30
    x[2, 160:192] *= 1e30
    native = gguf_linear.kernels().quantize_activations(x)
    for name, k in variants.items():
        assert torch.equal(k.quantize_activations(x), native), name


def test_a_fused_product_of_quantized_and_float_parts_is_each_parts_product():
    parts = [
        matrix(T.Q4_K, cols=512, seed=1)[0],
        matrix(T.F16, cols=512, seed=2)[0],
        matrix(T.Q8_0, cols=512)[0],
    ]
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(7))
    for exact in (False, True):
        fused = gguf_linear.block_matmul_parts(x, parts, exact)
        assert torch.equal(fused, torch.cat([block_matmul(x, p, exact) for p in parts], dim=-1))


@pytest.mark.parametrize("tokens", (1, 37), ids=("one-token", "past-a-token-block"))
def test_a_fused_layer_large_enough_to_run_in_parallel_is_each_parts_product(tokens):
    """One parallel region takes every part's tasks (ROW_TASK = 16 rows, TOKEN_BLOCK = 32 tokens in the C
    source): parts of row counts that end mid-task, of types with and without offsets, quantized and float,
    each land in their own columns with the bits of their own product."""
    parts = [
        matrix(T.Q4_K, rows=37, cols=2304, seed=1)[0],
        matrix(T.Q6_K, rows=21, cols=2304, seed=2)[0],
        matrix(T.F16, rows=5, cols=2304, seed=3)[0],
        matrix(T.Q8_0, rows=40, cols=2304, seed=4)[0],
    ]
    x = torch.randn(tokens, 2304, generator=torch.Generator().manual_seed(8))
    assert tokens * sum(p.rows for p in parts) * 2304 >= 65536  # PARALLEL_MIN_MACS: a parallel region
    for exact in (False, True):
        fused = gguf_linear.block_matmul_parts(x, parts, exact)
        assert torch.equal(fused, torch.cat([block_matmul(x, p, exact) for p in parts], dim=-1))


def test_the_layer_call_refuses_a_type_it_does_not_take_before_writing():
    k = gguf_linear.kernels()
    m, _ = matrix(T.Q4_K, rows=2, cols=256)
    x, out = torch.randn(1, 256), torch.full((1, 2), 7.0)
    act = k.quantize_activations(x)
    for qtype in (int(T.Q2_K), 99):
        desc = torch.tensor([[qtype, *m.address, 2]], dtype=torch.int64)
        assert (
            k._linear(x.data_ptr(), 1, 256, 256, 1, desc.data_ptr(), act.data_ptr(), out.data_ptr(), 2) == -1
        )
        assert torch.equal(out, torch.full((1, 2), 7.0))


def test_a_type_without_kernels_is_refused_by_name():
    with pytest.raises(UnsupportedBlockType, match="Q2_K"):
        BlockMatrix(int(T.Q2_K), 2, 256, torch.zeros(2, 84, dtype=torch.uint8))
    with pytest.raises(UnsupportedBlockType, match="unknown ggml type 99"):
        BlockMatrix(99, 2, 256, torch.zeros(2, 84, dtype=torch.uint8))


def test_bad_operands_are_python_errors():
    good = torch.zeros(2, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        BlockMatrix(int(T.Q4_K), 2, 128, good)
    with pytest.raises(ValueError, match=r"expected \(2, 288\)"):
        BlockMatrix(int(T.Q4_K), 2, 512, good)
    with pytest.raises(TypeError, match="uint8"):
        BlockMatrix(int(T.Q4_K), 2, 256, good.to(torch.int8))
    with pytest.raises(ValueError, match="contiguous"):
        BlockMatrix(int(T.Q4_K), 2, 256, torch.zeros(144, 2, dtype=torch.uint8).T)
    m = BlockMatrix(int(T.Q4_K), 2, 256, good)
    with pytest.raises(ValueError, match="256 input features"):
        block_matmul(torch.zeros(1, 128), m)
    with pytest.raises(TypeError, match="fp32"):
        block_matmul(torch.zeros(1, 256, dtype=torch.float64), m)
    with pytest.raises(IndexError):
        dequantize_rows(m, torch.tensor([2]))
    with pytest.raises(IndexError):
        dequantize_rows(m, torch.tensor([-1]))
    with pytest.raises(TypeError, match="int64"):
        dequantize_rows(m, torch.tensor([0], dtype=torch.int32))
    other = BlockMatrix(int(T.Q8_0), 2, 512, torch.zeros(2, 544, dtype=torch.uint8))
    with pytest.raises(ValueError, match="disagree on their input size"):
        gguf_linear.block_matmul_parts(torch.zeros(1, 256), [m, other])


def test_the_gguf_method_runs_a_fused_column_parallel_layer_of_mixed_types():
    """A Q4_K_M-style fused qkv: q and k in Q4_K, v in Q6_K; the output is the parts' products in order,
    plus the bias; the layer keeps no dense weight."""
    assert LINEAR_METHODS["gguf"] is GGUFLinearMethod
    cols = 256
    sizes = {"q": 8, "k": 4, "v": 4}
    layer = ColumnParallelLinear(cols, sizes, bias=True, tp=TensorParallelGroup(), method=GGUFLinearMethod())
    with torch.no_grad():
        layer.bias.copy_(torch.randn(16))
    x = torch.randn(2, 3, cols)
    with pytest.raises(RuntimeError, match="before its blocks were installed"):
        layer(x)
    parts = [
        matrix(T.Q4_K, rows=8, cols=cols, seed=1)[0],
        matrix(T.Q4_K, rows=4, cols=cols, seed=2)[0],
        matrix(T.Q6_K, rows=4, cols=cols, seed=3)[0],
    ]
    layer.method.install(layer, {WEIGHT: parts})
    assert layer.weight is None
    y = layer(x)
    expected = torch.cat([block_matmul(x, p) for p in parts], dim=-1) + layer.bias
    assert y.shape == (2, 3, 16)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    with pytest.raises(KeyError, match="missing"):
        GGUFLinearMethod().install(layer, {})
