"""The tiny model families the equality tests compare with transformers, through the model runner
(test/unit/test_model_families.py) and through a real server (test/integration/test_model_families_server.py):
random configs built from transformers' own config classes, each a (config, transformers' model class)."""

from __future__ import annotations

VOCAB = 512
WINDOW = 8
HEAD_DIM = 16
# Phi-3's LongRoPE and Llama's YaRN extend this pre-training length to max_position_embeddings; the prompts
# and their answers stay within it, where transformers' LongRoPE and srt's use the same (short) factors
ORIGINAL_CONTEXT = 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    max_position_embeddings=256,
    initializer_range=0.2,  # peaky logits: greedy near-ties are rare
    eos_token_id=None,
    bos_token_id=1,
    pad_token_id=0,
)


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**COMMON, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24)
    return config, Gemma2ForCausalLM


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=6,  # five local layers, then a global one
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 4.0},
        },
    )
    return config, Gemma3ForCausalLM


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralConfig(**COMMON, num_hidden_layers=3, sliding_window=WINDOW), MistralForCausalLM


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    return config, MixtralForCausalLM


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # a dense layer between two sparse ones
    )
    return config, Qwen3MoeForCausalLM


def phi3():
    """Fused qkv_proj/gate_up_proj in the checkpoint, LongRoPE (short factors that differ per frequency, an
    attention factor from the 4x extension) and a window on every layer."""
    from transformers import Phi3Config, Phi3ForCausalLM

    half = HEAD_DIM // 2
    config = Phi3Config(
        **COMMON,
        num_hidden_layers=3,
        sliding_window=WINDOW,
        original_max_position_embeddings=ORIGINAL_CONTEXT,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + 3.0 * i for i in range(half)],
        },
    )
    return config, Phi3ForCausalLM


def llama_yarn():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_CONTEXT,
    }
    return LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters=rope), LlamaForCausalLM


FAMILIES = {
    "gemma2": gemma2,
    "gemma3": gemma3,
    "mistral": mistral,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "phi3": phi3,
    "llama_yarn": llama_yarn,
}
