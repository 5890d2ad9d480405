"""`--quantization w8a8_int8` calibrates a Hugging Face checkpoint one decoder layer at a time
(srt/model_executor/int8_layerwise.py): the int8 weights are bit for bit those of calibrating the whole fp32
model over the same windows (quantization.py's order of work, which the runner ran until then), in every
family whose layers differ in what the loop sees (tied and untied heads, Gemma's embedding scale and per-layer
RoPE tables, experts fed only their routed tokens), and no more than one
decoder layer's weights are ever in memory."""

from __future__ import annotations

import itertools

import pytest
import torch

from srt.model_executor import int8_layerwise
from srt.model_executor.int8_layerwise import (
    CalibrationWindows,
    calibrate_layer_by_layer,
    calibration_window,
)
from srt.model_executor.layers.linear_method import UNQUANTIZED
from srt.model_executor.meta_build import on_meta_device
from srt.model_executor.model_loader import HFCheckpoint
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.models.registry import get_model_class
from srt.model_executor.quantization import calibration_ids, input_second_moments, quantize_model
from test.conftest import TINY_LLAMA, assets_config, save_random_llama, save_random_model
from test.model_families import gemma3, qwen3_moe

SEED = 11
# each with a 256-position context, so the calibration text runs as several windows
FAMILIES = {
    "llama_tied": None,
    "gemma3": gemma3,
    "qwen3_moe_untied": qwen3_moe,
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(request, model_assets_dir, tmp_path_factory) -> str:
    """A random fp32 checkpoint of the family, with the embedded model's tokenizer (the calibration text's
    ids must be in its vocabulary)."""
    out = tmp_path_factory.mktemp(request.param)
    vocab = assets_config(model_assets_dir)["vocab_size"]
    if FAMILIES[request.param] is None:
        fields = {**TINY_LLAMA, "vocab_size": vocab, "max_position_embeddings": 256}
        return save_random_llama(out, model_assets_dir, SEED, fields)
    config, model_class = FAMILIES[request.param]()
    config.vocab_size, config.architectures = vocab, [model_class.__name__]
    return save_random_model(out, model_assets_dir, SEED, config)


def meta_model(model_dir: str) -> torch.nn.Module:
    """The checkpoint's model built on the meta device, as the loader builds it before reading anything."""
    config = HFCheckpoint(model_dir).hf_config
    arch, model_class = get_model_class(config.architectures)
    with on_meta_device(torch.float32):
        return model_class(
            config, arch, config.max_position_embeddings, torch.float32, "cpu", None, UNQUANTIZED
        )


def test_layer_by_layer_gives_the_whole_models_int8_weights_bit_for_bit_one_layer_at_a_time(
    model_dir, monkeypatch
):
    # the whole fp32 model over the calibration windows, through a runner's pools (fp32 layers, fp32 KV)
    whole = ModelRunner(model_dir, max_total_tokens=512, quantization="none")
    window = calibration_window(whole.model)
    assert window < len(calibration_ids(model_dir))  # several windows: each layer sees them all in order
    windows = whole.forward_windows(calibration_ids(model_dir), window)
    expected = quantize_model(whole.model, input_second_moments(whole.model, windows))

    model = meta_model(model_dir)
    held_per_step = []  # the decoder layers in memory whenever a set of weights is quantized
    real = int8_layerwise.quantize_weights

    def spy(weights, moments):
        held_per_step.append([i for i, layer in enumerate(model.model.layers) if not on_meta(layer)])
        return real(weights, moments)

    monkeypatch.setattr(int8_layerwise, "quantize_weights", spy)
    attention = CalibrationWindows(model, window, "cpu", None, whole.attention_backend_name, torch.float32)
    got = calibrate_layer_by_layer(model, model_dir, attention, "cpu")
    assert sorted(got) == sorted(expected) and len(got) > 4
    for name, weight in expected.items():
        assert torch.equal(got[name].weight, weight.weight), name
        assert torch.equal(got[name].scale, weight.scale), name
    layers = len(model.model.layers)
    steps = [held for held, _ in itertools.groupby(held_per_step)]
    assert steps == [[i] for i in range(layers)] + [[]]  # each layer alone, then the head's turn
    assert all(p.is_meta for p in model.parameters())  # nothing left materialised


def on_meta(module: torch.nn.Module) -> bool:
    return all(p.is_meta for p in module.parameters())
