"""`--quantization w8a8_int8`: int8 layers agree with fp32 within quantization error, SmoothQuant helps where
activation outliers hurt, the loader quantizes a checkpoint once and reuses its cache, and the server's
default stays fp32 until int8 passes the quality gate (scripts/eval_quality.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from srt.model_executor.layers.int8_linear import (
    quantize_per_channel,
    quantize_per_token,
    smooth_factors,
    w8a8_linear,
)
from srt.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
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


def test_smoothing_is_an_identity_in_real_numbers_and_cuts_the_error_of_outlier_channels():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(128, 64, generator=gen) * 0.1
    calib, x = outlier_activations(256, 64, gen), outlier_activations(16, 64, gen)
    ref = F.linear(x, w)
    plain = rel_err(w8a8_linear(x, quantize_per_channel(w), None), ref)
    smooth = smooth_factors(calib.abs().amax(0), w, alpha=0.5)
    smoothed = rel_err(w8a8_linear(x, quantize_per_channel(w, smooth), None), ref)
    assert smoothed < plain / 2
    # the smoothed weight times the unsmoothed activation is the same product before rounding
    torch.testing.assert_close(F.linear(x / smooth, w * smooth), ref, rtol=1e-4, atol=1e-4)


def test_inputs_of_any_leading_shape_and_all_zero_rows():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 8, generator=gen)
    x = torch.randn(2, 3, 8, generator=gen)
    x[0, 1] = 0
    out = w8a8_linear(x, quantize_per_channel(w), None)
    assert out.shape == (2, 3, 16) and torch.isfinite(out).all()
    assert torch.equal(out[0, 1], torch.zeros(16))
    q, s = quantize_per_token(torch.zeros(1, 8))
    assert torch.equal(q, torch.zeros(1, 8, dtype=torch.int8)) and (s > 0).all()


def test_quantized_values_use_the_whole_int8_range_per_channel_and_per_token():
    gen = torch.Generator().manual_seed(3)
    qw = quantize_per_channel(torch.randn(10, 32, generator=gen))
    assert qw.weight.dtype == torch.int8 and qw.weight.shape == (10, 32)
    assert torch.equal(qw.weight.abs().amax(dim=1), torch.full((10,), 127, dtype=torch.int8))
    q, _ = quantize_per_token(torch.randn(5, 32, generator=gen))
    assert torch.equal(q.abs().amax(dim=1), torch.full((5,), 127, dtype=torch.int8))


def test_parallel_linear_layers_run_int8_when_quantized():
    gen = torch.Generator().manual_seed(4)
    tp = TensorParallelGroup()
    col, row = ColumnParallelLinear(8, {"a": 6}, bias=True, tp=tp), RowParallelLinear(6, 4, bias=True, tp=tp)
    for layer in (col, row):
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen))
        layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    x = torch.randn(3, 8, generator=gen)
    with torch.no_grad():
        ref = row(col(x))
        for layer in (col, row):
            layer.quant = quantize_per_channel(layer.weight.data)
        out = row(col(x))
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
    layers = [m for m in first.model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert layers and all(m.quant is not None and m.weight is None for m in layers)  # fp32 copies dropped
    assert first.model.lm_head_quant is not None
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


def test_int8_is_opt_in_until_it_passes_the_quality_gate_and_cpu_only():
    assert resolve_quantization(None, "cpu") == DEFAULT_CPU_QUANTIZATION == "none"
    assert resolve_quantization("w8a8_int8", "cpu") == "w8a8_int8"
    assert resolve_quantization(None, "cuda:0") == "none"
    assert resolve_quantization("none", "cpu") == "none"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("w8a8_int8", "cuda:0")
