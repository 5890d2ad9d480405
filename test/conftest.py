"""Shared model fixtures: the embedded SmolLM2 as a converted safetensors directory, and a tiny randomly
initialised Llama (same tokenizer and vocabulary) that makes model-level unit tests fast."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="session")
def tiny_model_dir(embedded_model_dir: str, tmp_path_factory) -> str:
    """A random 3-layer Llama saved as fp32 safetensors with SmolLM2's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(TINY_SEED)
    vocab_size = json.loads((Path(embedded_model_dir) / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab_size, architectures=["LlamaForCausalLM"], **TINY_LLAMA)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(embedded_model_dir) / name
        if src.exists():
            shutil.copy(src, out / name)
    return str(out)
