"""Tensor parallelism of a mixture-of-experts model: test_tensor_parallel.py's two-rank tests (sharded
logits = unsharded, lockstep schedulers = one rank, int8 ranks agree) run again on a tiny Qwen3-MoE, whose
ranks each hold half of every expert's inner dimension and sum their partial outputs in one all-reduce."""

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


@pytest.fixture(scope="module")
def tiny_model_dir(model_assets_dir: str, tmp_path_factory) -> str:
    """A random 3-layer Qwen3-MoE (8 experts, top 2; the middle layer dense) with SmolLM2's tokenizer."""
    from transformers import Qwen3MoeConfig

    fields = {k: v for k, v in TINY_LLAMA.items() if k != "num_hidden_layers"}
    config = Qwen3MoeConfig(
        **fields,
        vocab_size=assets_config(model_assets_dir)["vocab_size"],
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        architectures=["Qwen3MoeForCausalLM"],
    )
    return save_random_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), model_assets_dir, 11, config)
