"""Tensor parallelism of a checkpoint whose layers are stored fused: test_tensor_parallel.py's two-rank tests
(sharded logits = unsharded, lockstep schedulers = one rank, int8 ranks agree) run again on a tiny Phi-3,
whose `qkv_proj` and `gate_up_proj` tensors the loader splits into q/k/v and gate/up before each rank takes
its heads and features of every shard. LongRoPE's original context is shorter than the long prompt, so
both of its tables are read."""

from __future__ import annotations

import pytest

from test.conftest import TINY_LLAMA, assets_config, save_random_model

# the two-rank tests and their fixtures, collected again in this module with its `tiny_model_dir`
from test.unit.test_tensor_parallel import (  # noqa: F401
    rank_reports,
    single_rank,
    test_int8_ranks_quantize_their_own_shards_and_agree,
    test_lockstep_schedulers_generate_what_one_rank_generates,
    test_sharded_forward_gives_the_unsharded_logits,
)

ORIGINAL_CONTEXT = 16  # test_tensor_parallel's long prompt is 41 tokens


@pytest.fixture(scope="module")
def tiny_model_dir(model_assets_dir: str, tmp_path_factory) -> str:
    """A random 3-layer Phi-3 (fused checkpoint tensors, LongRoPE) with SmolLM2's tokenizer."""
    from transformers import Phi3Config

    half = TINY_LLAMA["head_dim"] // 2
    config = Phi3Config(
        **TINY_LLAMA,
        vocab_size=assets_config(model_assets_dir)["vocab_size"],
        original_max_position_embeddings=ORIGINAL_CONTEXT,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + 3.0 * i for i in range(half)],
        },
        architectures=["Phi3ForCausalLM"],
    )
    return save_random_model(tmp_path_factory.mktemp("tiny_phi3"), model_assets_dir, 13, config)
