"""A Llama 3.1 GGUF's rotary scaling: llama.cpp's converter stores it as a `rope_freqs` tensor (a divisor per
frequency) and states no scaling type. srt divides by it, so the model on the file's blocks matches
transformers running Llama 3's `rope_scaling` on the same weights; ignoring the tensor would not. A tensor
of the wrong shape or with a factor that is not finite and positive is one GGUFError line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from srt.model_executor.gguf_config import gguf_config
from srt.model_executor.gguf_file import GGUFError, GGUFFile
from srt.model_source import embedded_gguf_path
from test.unit.gguf_files import SHAPE, write_random_llama
from test.unit.model_driver import PagedDriver

THETA = 500000.0
# Llama 3.1's scheme over a small original context, so that most frequencies are scaled within the prompt
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
PROMPT_LEN = 160


def transformers_factors(head_dim: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes: transformers' plain frequencies over its llama3 ones."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=SHAPE["hidden"],
        num_attention_heads=SHAPE["heads"],
        max_position_embeddings=SHAPE["context"],
        rope_parameters={**LLAMA3, "rope_theta": THETA},
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (plain / scaled).numpy()


@pytest.fixture(scope="module")
def llama31(tmp_path_factory) -> tuple[str, str]:
    """(a Llama 3.1-style GGUF in F32 layers, the converter's fp32 directory of it with no scaling)."""
    from srt.model_executor.gguf_convert import convert

    root = tmp_path_factory.mktemp("rope_freqs")
    factors = transformers_factors(SHAPE["hidden"] // SHAPE["heads"])
    assert factors.max() > 2.0  # most frequencies scaled: the test can tell
    tokenizer = embedded_gguf_path("smollm2-135m-instruct")
    path = write_random_llama(
        root / "llama31.gguf", tokenizer, [T.F32, T.F32], seed=3, head_type=T.F32, rope=(THETA, factors)
    )
    convert(path, str(root / "converted"))
    return path, str(root / "converted")


def reference_logits(converted: str, ids: list[int], rope: dict) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with open(f"{converted}/config.json") as f:
        config = json.load(f)
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {**rope, "rope_theta": THETA}
    with open(f"{converted}/config.json", "w") as f:
        json.dump(config, f)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_rope_freqs_divide_the_frequencies_as_llama3_scaling_does(llama31):
    from srt.model_executor.model_runner import ModelRunner

    path, converted = llama31
    runner = ModelRunner(path, quantization="gguf", max_total_tokens=1024, max_running_requests=4)
    ids = torch.randint(
        0, runner.model.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.tolist()
    driver = PagedDriver(runner)
    got = driver.extend([driver.new_seq()], [ids], every_row=True).float()
    scaled = reference_logits(converted, ids, LLAMA3)
    plain = reference_logits(converted, ids, {"rope_type": "default"})
    err = float((got - scaled).abs().max())
    ignored = float((got - plain).abs().max())
    spread = float(scaled.std())
    # measured: 7e-4 of a 0.48 spread; without the factors 0.36 (the logits of another model)
    assert err < 0.01 * spread, (err, spread)
    assert ignored > 100 * err, (ignored, err)


@pytest.mark.parametrize(
    "factors, problem",
    [
        (np.ones(4, np.float32), r"rope_freqs\.weight is a F32 \(4,\), not F32 \(32,\)"),
        (np.array([1.0] * 31 + [0.0], np.float32), "not finite and positive"),
        (np.array([1.0] * 31 + [np.inf], np.float32), "not finite and positive"),
    ],
    ids=["short", "zero", "infinite"],
)
def test_a_bad_rope_freqs_tensor_is_one_line(tmp_path, factors, problem):
    path = write_random_llama(
        tmp_path / "bad.gguf", embedded_gguf_path("smollm2-135m-instruct"), [T.Q8_0], rope=(THETA, factors)
    )
    with pytest.raises(GGUFError, match=problem):
        gguf_config(GGUFFile.open(path))
