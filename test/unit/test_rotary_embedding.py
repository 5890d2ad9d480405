"""RoPE scaling gives transformers' frequencies, attention factors and cos/sin tables: Llama 3.1's, YaRN's and
LongRoPE's, over several parameter sets each, compared with transformers' own `ROPE_INIT_FUNCTIONS` and
rotary modules. LongRoPE's table takes the short factors below the original context and the long ones from
it on; transformers agrees position for position with a sequence that fits the original context (short)
and with one that runs past it (long)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from srt.model_executor.layers.rotary_embedding import RotaryEmbedding, rope_frequencies
from srt.model_executor.unsupported import UnsupportedModelError

SHAPE = dict(hidden_size=256, num_attention_heads=4)  # head_dim 64
HEAD_DIM = 64
TABLE_DTYPE = torch.float32


def llama(rope: dict, **fields) -> LlamaConfig:
    return LlamaConfig(**SHAPE, head_dim=HEAD_DIM, rope_parameters=rope, **fields)


def phi3(rope: dict, **fields) -> Phi3Config:
    # Phi-3 keeps original_max_position_embeddings beside its rope_scaling, not inside it
    return Phi3Config(**SHAPE, rope_scaling=rope, **fields)


def factors(seed: int, low: float, high: float) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    return (low + (high - low) * torch.rand(HEAD_DIM // 2, generator=gen)).tolist()


YARN = {
    "factor 4, default betas": llama(
        {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=256,
    ),
    "other betas, untruncated": llama(
        {
            "rope_type": "yarn",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 2048,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
        max_position_embeddings=16384,
    ),
    "mscale over mscale_all_dim": llama(
        {
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        max_position_embeddings=163840,
    ),
    "explicit attention factor": llama(
        {
            "rope_type": "yarn",
            "rope_theta": 1_000_000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 32768,
            "attention_factor": 0.9,
        },
        max_position_embeddings=65536,
    ),
}

LONGROPE = {
    "factor from the lengths": phi3(
        {"type": "longrope", "short_factor": factors(0, 1.0, 1.5), "long_factor": factors(1, 1.0, 40.0)},
        max_position_embeddings=256,
        original_max_position_embeddings=64,
    ),
    "explicit attention factor": phi3(
        {
            "type": "longrope",
            "short_factor": factors(2, 0.9, 1.1),
            "long_factor": factors(3, 2.0, 8.0),
            "attention_factor": 1.25,
        },
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        rope_theta=250_000.0,
    ),
    "no extension (factor 1)": phi3(
        {"type": "longrope", "short_factor": factors(4, 1.0, 2.0), "long_factor": factors(5, 1.0, 2.0)},
        max_position_embeddings=128,
        original_max_position_embeddings=128,
    ),
}


def theirs(config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


def plain_inv_freq(theta: float) -> torch.Tensor:
    return rope_frequencies(llama({"rope_type": "default", "rope_theta": theta}), HEAD_DIM).inv_freq


@pytest.mark.parametrize("name", list(YARN))
def test_yarn_gives_transformers_frequencies_and_attention_factor(name):
    config = YARN[name]
    ours = rope_frequencies(config, HEAD_DIM)
    inv_freq, attention_factor = theirs(config)
    torch.testing.assert_close(ours.inv_freq, inv_freq.float())
    assert ours.attention_scaling == pytest.approx(attention_factor, rel=1e-12)
    assert ours.long_inv_freq is None
    # the blend is not vacuous: some dimensions kept, some interpolated
    plain = plain_inv_freq(config.rope_parameters["rope_theta"])
    assert torch.isclose(ours.inv_freq[0], plain[0])
    assert torch.isclose(ours.inv_freq[-1], plain[-1] / config.rope_parameters["factor"])


def test_yarn_attention_factor_follows_the_scale():
    assert rope_frequencies(YARN["factor 4, default betas"], HEAD_DIM).attention_scaling > 1
    assert rope_frequencies(YARN["explicit attention factor"], HEAD_DIM).attention_scaling == 0.9


@pytest.mark.parametrize("name", list(LONGROPE))
def test_longrope_gives_transformers_short_and_long_frequencies(name):
    config = LONGROPE[name]
    original = config.original_max_position_embeddings
    ours = rope_frequencies(config, HEAD_DIM)
    short, attention_factor = theirs(config)  # at initialisation: the short factors
    long, long_attention_factor = theirs(config, seq_len=original + 1)
    torch.testing.assert_close(ours.inv_freq, short.float())
    torch.testing.assert_close(ours.long_inv_freq, long.float())
    assert ours.long_from == original
    assert ours.attention_scaling == pytest.approx(attention_factor, rel=1e-12)
    assert ours.attention_scaling == pytest.approx(long_attention_factor, rel=1e-12)


def test_longrope_attention_factor_grows_with_the_extension():
    extended = rope_frequencies(LONGROPE["factor from the lengths"], HEAD_DIM).attention_scaling
    assert extended > 1
    assert rope_frequencies(LONGROPE["no extension (factor 1)"], HEAD_DIM).attention_scaling == 1.0


def hf_tables(config, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin for positions 0..length-1 of one sequence, one half of the head."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    module = (Phi3RotaryEmbedding if isinstance(config, Phi3Config) else LlamaRotaryEmbedding)(config)
    x = torch.zeros(1, dtype=TABLE_DTYPE)
    cos, sin = module(x, torch.arange(length)[None])
    return cos[0, :, : HEAD_DIM // 2], sin[0, :, : HEAD_DIM // 2]


@pytest.mark.parametrize("name", list(LONGROPE))
def test_longrope_tables_are_short_below_the_original_length_and_long_from_it(name):
    config = LONGROPE[name]
    original, total = config.original_max_position_embeddings, 2 * config.original_max_position_embeddings
    rope = RotaryEmbedding(config, HEAD_DIM, total, TABLE_DTYPE, "cpu")
    short_cos, short_sin = hf_tables(config, original)  # the sequence fits: short factors throughout
    long_cos, long_sin = hf_tables(config, total)  # past the original length: long factors throughout
    torch.testing.assert_close(rope.cos[:original], short_cos)
    torch.testing.assert_close(rope.sin[:original], short_sin)
    torch.testing.assert_close(rope.cos[original:], long_cos[original:])
    torch.testing.assert_close(rope.sin[original:], long_sin[original:])
    # where transformers and srt differ: a long sequence's early positions (transformers: long factors)
    assert not torch.allclose(rope.cos[1:original], long_cos[1:original])


@pytest.mark.parametrize("name", ["factor 4, default betas", "explicit attention factor"])
def test_yarn_tables_equal_transformers(name):
    config = YARN[name]
    length = 300
    rope = RotaryEmbedding(config, HEAD_DIM, length, TABLE_DTYPE, "cpu")
    cos, sin = hf_tables(config, length)
    torch.testing.assert_close(rope.cos, cos)
    torch.testing.assert_close(rope.sin, sin)


def test_llama3_gives_transformers_frequencies():
    config = llama(
        {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    )
    ours = rope_frequencies(config, HEAD_DIM)
    inv_freq, attention_factor = theirs(config)
    torch.testing.assert_close(ours.inv_freq, inv_freq.float())
    assert ours.attention_scaling == attention_factor == 1.0
    assert not torch.allclose(ours.inv_freq, plain_inv_freq(500_000.0))  # the scaling did something


@pytest.mark.parametrize(
    ("config", "what"),
    [
        (llama({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "rope type 'dynamic'"),
        (llama({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}), "partial_rotary"),
        (
            llama(
                {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 3,
                    "long_factor": [1.0] * 3,
                }
            ),
            "short_factor has 3 entries",
        ),
    ],
    ids=["dynamic", "partial-rotary", "factor-length"],
)
def test_what_srt_does_not_rotate_is_refused(config, what):
    with pytest.raises(UnsupportedModelError, match=what):
        rope_frequencies(config, HEAD_DIM)
