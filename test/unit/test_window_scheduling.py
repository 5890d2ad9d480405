"""The scheduler's equivalences hold for a model with sliding-window and soft-capped layers: the tests of
test_scheduler.py (batched = alone, chunked = whole, prefix hit = cold, retracted = not retracted, each with
and without mixed steps, in fp32 and in int8 on the CPU kernels) run here again on a tiny Gemma 2 whose
8-token window is shorter than every prompt, so a windowed layer that saw a key it must not, or missed one
it must see, after a chunk boundary, a prefix hit or a retraction, changes the tokens."""

from __future__ import annotations

import pytest

from test.conftest import TINY_LLAMA, assets_config, save_random_model

# the equivalence tests and their fixtures, collected again in this module with its `tiny_model_dir`
from test.unit.test_scheduler import (  # noqa: F401
    alone_outputs,
    private_int8_cache,
    quant,
    test_chunked_prefill_gives_same_tokens,
    test_continuous_batching_matches_running_alone,
    test_prefix_cache_hit_gives_same_tokens,
    test_retraction_resumes_with_identical_output,
)

WINDOW = 8


@pytest.fixture(scope="module")
def tiny_model_dir(model_assets_dir: str, tmp_path_factory) -> str:
    """A random 4-layer Gemma 2 (local, global, local, global; attention and final soft-caps) with
    SmolLM2's tokenizer, saved as fp32 safetensors."""
    from transformers import Gemma2Config

    fields = {k: v for k, v in TINY_LLAMA.items() if k not in ("rope_theta", "num_hidden_layers")}
    config = Gemma2Config(
        **fields,
        vocab_size=assets_config(model_assets_dir)["vocab_size"],
        num_hidden_layers=4,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        architectures=["Gemma2ForCausalLM"],
    )
    return save_random_model(tmp_path_factory.mktemp("tiny_gemma2"), model_assets_dir, 7, config)
