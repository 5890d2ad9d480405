"""`--quantization w8a8_int8`: int8 layers agree with fp32 within quantization error, two-level activations
make outlier channels harmless, GPTQ rounding beats nearest rounding on the layer's output, and the loader
quantizes a checkpoint once and reuses its cache."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from srt.model_executor.layers import cpu_kernels, int8_linear
from srt.model_executor.layers.gptq import quantize_per_channel_gptq
from srt.model_executor.layers.int8_linear import pack_weight, packed_kernel_available, w8a8_linear
from srt.model_executor.layers.int8_math import quantize_per_channel, quantize_two_level, torch_w8a8_linear
from srt.model_executor.layers.layernorm import RMSNorm
from srt.model_executor.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from srt.model_executor.layers.linear_method import WEIGHT, W8A8Int8LinearMethod
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.quantization import DEFAULT_CPU_QUANTIZATION, cache_path, resolve_quantization
from test.unit.model_driver import PagedDriver


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def outlier_activations(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Hidden states as a Llama has them: a few input channels 50x larger than the rest."""
    x = torch.randn(rows, k, generator=gen)
    x[:, :3] *= 50
    return x


# ---- one layer on random data ----
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_w8a8_linear_matches_fp32_within_quantization_error(rows):
    gen = torch.Generator().manual_seed(rows)
    w, x, b = (
        torch.randn(96, 80, generator=gen),
        torch.randn(rows, 80, generator=gen),
        torch.randn(96, generator=gen),
    )
    out = w8a8_linear(x, quantize_per_channel(w), b)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    assert rel_err(out, F.linear(x, w, b)) < 0.02


def test_two_level_activations_make_outlier_channels_harmless():
    """Per-token int8 alone flattens every ordinary channel to a few levels next to a 50x outlier; the
    residual level restores them, leaving only the weights' rounding."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(128, 64, generator=gen) * 0.1
    x = outlier_activations(16, 64, gen)
    qw = quantize_per_channel(w)
    w_int8 = qw.weight.float() * qw.scale.unsqueeze(1)
    ref = F.linear(x, w_int8)  # exact activations against the same int8 weights: the activations' error alone
    q, s = quantize_two_level(x)
    one_level = F.linear(q[:16].float() * s[:16], w_int8)  # the first level alone: plain per-token int8
    two_level = w8a8_linear(x, qw, None)
    assert rel_err(one_level, ref) > 0.005
    assert rel_err(two_level, ref) < rel_err(one_level, ref) / 50
    assert rel_err(two_level, F.linear(x, w)) < 0.01


def test_the_second_level_quantizes_what_the_first_left():
    gen = torch.Generator().manual_seed(5)
    x = outlier_activations(3, 40, gen)
    q, s = quantize_two_level(x)
    assert q.dtype == torch.int8 and q.shape == (6, 40) and s.shape == (6, 1)
    first, second = q[:3].float() * s[:3], q[3:].float() * s[3:]
    assert (s[3:] < s[:3] / 100).all()  # the residual is at most half a step of the first level
    assert (x - first - second).abs().max() <= s[3:].max() / 2 + 1e-6


def correlated_inputs(rows: int, k: int, mix: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Rows whose channels are correlated through `mix`, as hidden states are."""
    return torch.randn(rows, k, generator=gen) @ mix


def test_gptq_rounding_cuts_the_output_error_on_unseen_inputs_of_the_calibrated_kind():
    gen = torch.Generator().manual_seed(6)
    k, n = 64, 48
    mix = torch.randn(k, k, generator=gen) * 0.3 + torch.eye(k)
    w = torch.randn(n, k, generator=gen) * 0.1
    calib, held_out = correlated_inputs(512, k, mix, gen), correlated_inputs(256, k, mix, gen)
    nearest = quantize_per_channel(w)
    gptq = quantize_per_channel_gptq(w, calib.t() @ calib)
    assert torch.equal(gptq.scale, nearest.scale)  # same format, same scales: only the levels differ
    assert gptq.weight.dtype == torch.int8 and not torch.equal(gptq.weight, nearest.weight)

    def output_error(qw) -> float:
        return rel_err(F.linear(held_out, qw.weight.float() * qw.scale.unsqueeze(1)), F.linear(held_out, w))

    assert output_error(gptq) < output_error(nearest) * 0.8


def test_gptq_rounds_channels_calibration_never_saw_to_their_nearest_level():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(8, 16, generator=gen)
    x = torch.randn(32, 16, generator=gen)
    x[:, 0] = 0  # the first channel: rounded before any error reaches it, so nearest is all it can be
    qw = quantize_per_channel_gptq(w, x.t() @ x)
    assert torch.equal(qw.weight[:, 0], quantize_per_channel(w).weight[:, 0])
    assert qw.weight[:, 0].abs().sum() > 0 and torch.isfinite(qw.scale).all()


def test_gptq_leaves_the_callers_moments_as_they_were_in_either_precision():
    """GPTQ dampens its own float64 copy of H: a float64 H is not edited in place (a dead channel's diagonal,
    the dampening), and gives the levels its float32 form gives."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(8, 16, generator=gen)
    x = torch.randn(32, 16, generator=gen)
    x[:, 3] = 0  # a dead channel: its diagonal is set in the copy
    h32 = x.t() @ x
    h64 = h32.double()
    before = h64.clone()
    qw64 = quantize_per_channel_gptq(w, h64)
    assert torch.equal(h64, before)
    assert torch.equal(qw64.weight, quantize_per_channel_gptq(w, h32).weight)


@pytest.mark.skipif(
    not packed_kernel_available(), reason="this torch build has no exact, fast oneDNN int8 linear"
)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_the_packed_kernel_gives_the_bits_of_int_mm(rows):
    """Integer products are exact, so the two kernels must agree to the bit, at every batch size."""
    gen = torch.Generator().manual_seed(8)
    w, x, b = torch.randn(72, 48, generator=gen), torch.randn(rows, 48, generator=gen), torch.randn(72)
    plain, packed = quantize_per_channel(w), quantize_per_channel(w)
    assert pack_weight(packed) and packed.packed is not None and plain.packed is None
    # the packed form replaces the plain one, unless the fused linear reads it (a few tokens, with VNNI)
    kernels = cpu_kernels.load()
    assert (packed.weight is None) == (kernels is None or not kernels.use_small_linear)
    assert torch.equal(w8a8_linear(x, packed, b), w8a8_linear(x, plain, b))


def test_inputs_of_any_leading_shape_and_all_zero_rows():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 8, generator=gen)
    x = torch.randn(2, 3, 8, generator=gen)
    x[0, 1] = 0
    out = w8a8_linear(x, quantize_per_channel(w), None)
    assert out.shape == (2, 3, 16) and torch.isfinite(out).all()
    assert torch.equal(out[0, 1], torch.zeros(16))
    q, s = quantize_two_level(torch.zeros(1, 8))
    assert torch.equal(q, torch.zeros(2, 8, dtype=torch.int8)) and (s > 0).all()


def test_weights_use_the_whole_int8_range_per_channel_and_activations_seven_bits_per_token():
    """Activations stay within [-63, 63] in both levels: together they are one int16 of at most 8001, whose
    products with int8 weights AVX2 sums exactly in int32, and offset by 64 they are the unsigned bytes
    VNNI's vpdpbusd takes."""
    gen = torch.Generator().manual_seed(3)
    qw = quantize_per_channel(torch.randn(10, 32, generator=gen))
    assert qw.weight.dtype == torch.int8 and qw.weight.shape == (10, 32)
    assert torch.equal(qw.weight.abs().amax(dim=1), torch.full((10,), 127, dtype=torch.int8))
    x = torch.randn(5, 32, generator=gen)
    x[:, 0] *= 100.0  # an outlier channel sets each row's scale
    q, _ = quantize_two_level(x)
    assert torch.equal(q[:5].abs().amax(dim=1), torch.full((5,), 63, dtype=torch.int8))
    assert q[5:].abs().max() <= 63 and q[5:].abs().max() >= 50  # the residual uses its range too


def test_parallel_linear_layers_run_int8_once_their_method_gets_int8_weights():
    """A layer built with the int8 method multiplies its fp32 weight (what calibration runs) until the method
    is given the int8 form, then only that (the fp32 copy is dropped)."""
    gen = torch.Generator().manual_seed(4)
    tp = TensorParallelGroup()
    col = ColumnParallelLinear(8, {"a": 6}, bias=True, tp=tp, method=W8A8Int8LinearMethod())
    row = RowParallelLinear(6, 4, bias=True, tp=tp, method=W8A8Int8LinearMethod())
    for layer in (col, row):
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen))
        layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    x = torch.randn(3, 8, generator=gen)
    with torch.no_grad():
        ref = row(col(x))
        assert torch.equal(ref, F.linear(F.linear(x, col.weight, col.bias), row.weight, row.bias))
        for layer in (col, row):
            layer.method.install(layer, {WEIGHT: quantize_per_channel(layer.weight.data)})
        out = row(col(x))
    assert col.weight is None and row.weight is None
    assert not torch.equal(out, ref)  # really a different (int8) computation ...
    assert rel_err(out, ref) < 0.03  # ... within its error


# ---- the whole tiny model through the loader ----
@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("SRT_CACHE_DIR", str(tmp_path))
    return str(tmp_path)


def logits_of(runner: ModelRunner) -> torch.Tensor:
    driver = PagedDriver(runner)
    seqs = [driver.new_seq(), driver.new_seq()]
    first = driver.extend(seqs, [list(range(10, 40)), [5, 6, 7, 8, 9]])
    return torch.cat([first, driver.decode(seqs, [41, 10])])  # fixed tokens: the same inputs for every model


def test_int8_model_tracks_fp32_and_its_cache_is_reused(tiny_model_dir, private_cache):
    fp32 = logits_of(ModelRunner(tiny_model_dir, max_total_tokens=256))
    first = ModelRunner(tiny_model_dir, max_total_tokens=256, quantization="w8a8_int8")
    path = cache_path(first.model_dir, 0, 1)
    assert os.path.isfile(path) and path.startswith(private_cache)
    layers = [m for m in first.model.modules() if isinstance(m, LinearBase)]
    assert len(layers) == 3 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    weights = [m.method.int8_weight() for m in layers]
    assert all(w is not None for w in weights) and all(
        m.weight is None for m in layers
    )  # fp32 copies dropped
    norms = [m for m in first.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernels is cpu_kernels.load() for m in norms)  # fused where they loaded
    assert all((w.packed is not None) == packed_kernel_available() for w in weights)
    int8 = logits_of(first)
    assert rel_err(int8, fp32) < 0.05
    mtime = os.stat(path).st_mtime_ns
    second = ModelRunner(tiny_model_dir, max_total_tokens=256, quantization="w8a8_int8")
    assert os.stat(path).st_mtime_ns == mtime  # loaded, not recalibrated and rewritten
    assert torch.equal(logits_of(second), int8)


def test_an_unreadable_cache_file_is_rebuilt_not_fatal(tiny_model_dir, private_cache):
    runner = ModelRunner(tiny_model_dir, max_total_tokens=256, quantization="w8a8_int8")
    path = cache_path(runner.model_dir, 0, 1)
    reference = logits_of(runner)
    with open(path, "wb") as f:
        f.write(b"not a safetensors file")
    again = ModelRunner(tiny_model_dir, max_total_tokens=256, quantization="w8a8_int8")
    assert torch.equal(logits_of(again), reference)
    assert os.path.getsize(path) > 100


def test_int8_is_the_cpu_default_since_it_passed_the_quality_gate_and_is_cpu_only():
    assert resolve_quantization(None, "cpu") == DEFAULT_CPU_QUANTIZATION == "w8a8_int8"
    assert resolve_quantization("w8a8_int8", "cpu") == "w8a8_int8"
    assert resolve_quantization(None, "cuda:0") == "none"
    assert resolve_quantization("none", "cpu") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("w8a8_int8", "cuda:0")


def test_without_an_exact_onednn_kernel_the_fused_linear_takes_every_batch(monkeypatch):
    """On AVX2 without VNNI oneDNN's int8 linear saturates (the probe rejects it) and `_int_mm` is many
    times slower than fp32: the plain weight stays, for srt's fused kernel at any size."""
    monkeypatch.setattr(int8_linear, "packed_kernel_available", lambda: False)
    gen = torch.Generator().manual_seed(9)
    w, b = torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    qw = quantize_per_channel(w)
    assert not pack_weight(qw) and qw.packed is None and qw.weight is not None
    for rows in (1, 50):
        x = torch.randn(rows, 64, generator=gen)
        assert torch.equal(w8a8_linear(x, qw, b), torch_w8a8_linear(x, qw, b))


def mapped_file_of(t: torch.Tensor) -> str | None:
    """The file whose mapping holds t's data, from /proc/self/maps (None: anonymous memory, [heap] included)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[5] if len(fields) > 5 and not fields[5].startswith("[") else None
    return None


def test_the_int8_model_maps_its_lookup_only_embedding_from_the_checkpoint(tiny_model_dir, private_cache):
    """With the head in int8 the fp32 table is only looked up: a memory map of the checkpoint (only the rows
    of tokens seen become resident), with the same values."""
    fp32 = ModelRunner(tiny_model_dir, max_total_tokens=256)
    int8 = ModelRunner(tiny_model_dir, max_total_tokens=256, quantization="w8a8_int8")
    held, mapped = fp32.model.model.embed_tokens.weight, int8.model.model.embed_tokens.weight
    assert mapped_file_of(held) is None  # the fp32 model's head may read all of it: held in memory
    assert mapped_file_of(mapped).startswith(os.path.realpath(int8.model_dir))
    assert torch.equal(mapped, held)


def test_the_int8_model_keeps_its_kv_cache_in_fp16_where_its_kernels_attend(tiny_model_dir, private_cache):
    from srt.engine_options import KV_CACHE_DTYPES
    from srt.model_executor.runner_setup import resolve_kv_cache_dtype

    for name in KV_CACHE_DTYPES:  # every choice the flag offers, the runner takes
        assert isinstance(resolve_kv_cache_dtype(name, "w8a8_int8", "cpu", torch.float32), torch.dtype)
    auto = ModelRunner(tiny_model_dir, max_total_tokens=256, quantization="w8a8_int8")
    expected = torch.float16 if cpu_kernels.load() is not None else torch.float32
    assert auto.kv_cache_dtype == expected and auto.token_to_kv_pool.get_kv_buffer(0)[0].dtype == expected
    asked = ModelRunner(
        tiny_model_dir, max_total_tokens=256, quantization="w8a8_int8", kv_cache_dtype="float32"
    )
    assert asked.token_to_kv_pool.get_kv_buffer(0)[0].dtype == torch.float32
    assert rel_err(logits_of(auto), logits_of(asked)) < 0.01  # fp16 rounding of K/V only


def test_a_cached_start_never_reads_the_fp32_weights_int8_replaces_or_the_embedding(
    tiny_model_dir, private_cache, monkeypatch
):
    from srt.model_executor import model_loader

    real, read = model_loader.iter_checkpoint, []

    def spy(model_dir, wanted=None):
        for name, tensor in real(model_dir, wanted):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(model_loader, "iter_checkpoint", spy)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    first = ModelRunner(tiny_model_dir, max_total_tokens=256, quantization="w8a8_int8")  # calibrates
    assert any(p in name for name in read for p in projections)
    read.clear()
    second = ModelRunner(tiny_model_dir, max_total_tokens=256, quantization="w8a8_int8")  # from the cache
    assert any("layernorm" in name for name in read)  # what int8 does not replace is read
    assert not [name for name in read if any(p in name for p in projections)]
    assert "model.embed_tokens.weight" not in read  # mapped instead (a lookup table once the head is int8)
    assert torch.equal(logits_of(second), logits_of(first))


def test_a_packed_kernel_that_is_a_slow_fallback_is_not_used(monkeypatch):
    """oneDNN may run its reference int8 matmul (seen: ~1,300x slower than `_int_mm` on a Zen 4 EPYC):
    exact, so only the speed probe can refuse it, and the weights then stay plain. When fast, the kernel is
    used where it exists and is exact here (without VNNI it is not: on a Zen 1 EPYC its products were off by
    up to 31,320 in 122,445)."""
    from srt.model_executor.layers import int8_linear

    monkeypatch.setattr(int8_linear, "cpu_flags", lambda: frozenset({"avx512_vnni", "amx_int8"}))
    monkeypatch.setattr(int8_linear, "packed_kernel_speed_ratio", lambda: 1_000.0)
    int8_linear.packed_kernel_available.cache_clear()
    try:
        assert not int8_linear.packed_kernel_available()
        qw = quantize_per_channel(torch.randn(16, 64))
        assert not pack_weight(qw) and qw.packed is None and qw.weight is not None
    finally:
        int8_linear.packed_kernel_available.cache_clear()
    monkeypatch.setattr(int8_linear, "packed_kernel_speed_ratio", lambda: 1.0)
    try:
        assert int8_linear.packed_kernel_available() == (_packed_kernel_exists() and _packed_kernel_exact())
    finally:
        int8_linear.packed_kernel_available.cache_clear()


def test_without_amx_the_packed_kernel_is_not_probed(monkeypatch):
    """Every CPU without AMX measured ran oneDNN's reference kernel, and the probe that finds it out costs
    seconds of a start: there it is not run, and the weights stay plain."""
    from srt.model_executor.layers import int8_linear

    flags = int8_linear.cpu_flags()
    assert flags is None or "fpu" in flags  # Linux's list, as read

    def probe() -> float:
        raise AssertionError("probed")

    monkeypatch.setattr(int8_linear, "packed_kernel_speed_ratio", probe)
    monkeypatch.setattr(int8_linear, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    int8_linear.packed_kernel_available.cache_clear()
    try:
        assert not int8_linear.packed_kernel_available()
        qw = quantize_per_channel(torch.randn(16, 64))
        assert not pack_weight(qw) and qw.weight is not None
    finally:
        int8_linear.packed_kernel_available.cache_clear()


def _packed_kernel_exists() -> bool:
    return hasattr(torch.ops.onednn, "qlinear_pointwise")


def _packed_kernel_exact() -> bool:
    """Whether oneDNN's packed products equal `_int_mm`'s on full-range int8 rows (unit scales)."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randint(-127, 128, (32, 128), dtype=torch.int8, generator=gen)
    x = torch.randint(-127, 128, (6, 128), dtype=torch.int8, generator=gen)
    weight = int8_linear.Int8Weight(w, torch.ones(32))
    weight.pack_unchecked()
    return torch.equal(int8_linear.packed_int8_matmul(x, weight), torch._int_mm(x, w.t()).to(torch.float32))
