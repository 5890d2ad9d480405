"""Rotary position embeddings: the inverse frequencies a config asks for and the cos/sin tables built from them.

Every family reads its RoPE here (`rope_parameters` in transformers 5, `rope_theta` + `rope_scaling` before,
or one set per layer type, as Gemma 3 has), so a new scaling scheme is one function in `SCHEMES`, not one per
model. The definitions follow transformers' `modeling_rope_utils`, the reference the tests compare with.

LongRoPE (Phi-3) has two sets of frequencies, and here the position picks one: positions below
`original_max_position_embeddings` rotate by the short factors, later ones by the long factors, in one table
built at construction. transformers instead picks by the sequence's length: the whole sequence uses the
short factors until it grows past the original length, then every position (earlier ones included,
recomputing the cached keys) uses the long ones. Both agree on any sequence that fits the original length;
past it, srt's keys cached before the boundary keep their short-factor rotation. The per-position choice
keeps the KV cache valid as a sequence grows and makes a token's numbers independent of its batch-mates
(vLLM switches a whole step to the long factors when any of its positions is past the boundary).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from srt.model_executor.unsupported import UnsupportedModelError

DEFAULT_ROPE_THETA = 10000.0
# YaRN's ramp bounds in rotations over the original context, as the paper suggests (transformers' defaults)
YARN_BETA_FAST = 32
YARN_BETA_SLOW = 1
# keeps YaRN's ramp finite where its two bounds meet (transformers' value)
YARN_RAMP_EPSILON = 0.001


@dataclass(frozen=True)
class RopeFrequencies:
    """A config's rotary frequencies: `inv_freq` at every position, or, where `long_from` is set (LongRoPE),
    `inv_freq` below that position and `long_inv_freq` from it on. cos and sin are multiplied by
    `attention_scaling` (YaRN's and LongRoPE's attention factor; 1 otherwise)."""

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    long_from: int | None = None

    def angles(self, max_positions: int) -> torch.Tensor:
        """[max_positions, head_dim // 2]: each position times each frequency."""
        t = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        angles = torch.outer(t, self.inv_freq)
        if self.long_inv_freq is not None and self.long_from < max_positions:
            angles[self.long_from :] = torch.outer(t[self.long_from :], self.long_inv_freq)
        return angles


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The config's RoPE fields as one dict (`rope_parameters` over the older `rope_scaling`; the layer
    type's own set where the config gives one per type), with `rope_theta` and `rope_type` resolved."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or DEFAULT_ROPE_THETA)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def original_max_positions(config, params: dict) -> int:
    """The pre-training context length that YaRN, LongRoPE and Llama 3.1 scale from: Phi-3 keeps it beside
    `rope_scaling` (and transformers prefers that one), the others inside."""
    return (
        getattr(config, "original_max_position_embeddings", None)
        or params.get("original_max_position_embeddings")
        or config.max_position_embeddings
    )


def _default(powers: torch.Tensor, params: dict, config) -> RopeFrequencies:
    return RopeFrequencies(1.0 / powers)


def _linear(powers: torch.Tensor, params: dict, config) -> RopeFrequencies:
    return RopeFrequencies(1.0 / powers / params["factor"])  # positions divided by the factor


def _llama3(powers: torch.Tensor, params: dict, config) -> RopeFrequencies:
    """Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth blend between."""
    inv_freq = 1.0 / powers
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = original_max_positions(config, params)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return RopeFrequencies(torch.where(is_medium, smoothed, scaled))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(powers: torch.Tensor, params: dict, config) -> RopeFrequencies:
    """YaRN: dimensions that turn more than `beta_fast` times over the original context keep their
    frequency (extrapolated), those that turn fewer than `beta_slow` times are divided by the factor
    (interpolated), a linear ramp blends the ones between; cos and sin are scaled by the attention factor
    (0.1 ln(factor) + 1, or the ratio of its `mscale` and `mscale_all_dim` forms where both are given)."""
    original = original_max_positions(config, params)
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    dim, theta = 2 * powers.numel(), params["rope_theta"]

    def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = dimension_of(params.get("beta_fast") or YARN_BETA_FAST)
    high = dimension_of(params.get("beta_slow") or YARN_BETA_SLOW)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += YARN_RAMP_EPSILON
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    blended = 1.0 / (factor * powers) * (1 - extrapolated) + 1.0 / powers * extrapolated
    return RopeFrequencies(blended, float(attention_factor))


def _longrope(powers: torch.Tensor, params: dict, config) -> RopeFrequencies:
    """LongRoPE: each frequency divided by its own factor, `short_factor` within the original context and
    `long_factor` past it; cos and sin scaled by sqrt(1 + ln(factor) / ln(original)), factor being
    max_position_embeddings / original unless given."""
    original = original_max_positions(config, params)
    factor = params.get("factor") or config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def scaled(name: str) -> torch.Tensor:
        factors = torch.tensor(params[name], dtype=torch.float32, device="cpu")
        if factors.shape != powers.shape:
            raise UnsupportedModelError(
                f"longrope {name} has {factors.numel()} entries, not head_dim / 2 = {powers.numel()}"
            )
        return 1.0 / (factors * powers)

    return RopeFrequencies(scaled("short_factor"), float(attention_factor), scaled("long_factor"), original)


# rope_type -> its frequencies from theta^(2i / head_dim) (the plain inverse frequencies' reciprocals), the
# parameters and the config; each divides in transformers' order, so the tables agree to the last bits
SCHEMES: dict[str, Callable[[torch.Tensor, dict, object], RopeFrequencies]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


def rope_frequencies(config, head_dim: int, layer_type: str | None = None) -> RopeFrequencies:
    """The rotary frequencies the config asks for (per layer type where it gives one set per type)."""
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SCHEMES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (srt runs {', '.join(SCHEMES)})"
        )
    partial = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    if partial != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor {partial} is not supported (srt rotates the whole head)"
        )
    # explicit CPU device: the model may be constructed under a `meta` device context
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    freqs = SCHEMES[rope_type](params["rope_theta"] ** exponents, params, config)
    factors = getattr(config, ROPE_FREQ_FACTORS, None)
    if factors is None:
        return freqs
    return divided_by_factors(freqs, factors)


# A config attribute (not a transformers field) holding one divisor per frequency: a GGUF's `rope_freqs`
# tensor, which is how llama.cpp's converter stores Llama 3.1's scaling (the file states no scaling type)
ROPE_FREQ_FACTORS = "rope_freq_factors"


def divided_by_factors(freqs: RopeFrequencies, factors) -> RopeFrequencies:
    """Each frequency divided by its own factor, as ggml's rope divides by `rope_freqs` (after the scheme's
    own scaling, which such files leave at none)."""
    factors = torch.as_tensor(factors, dtype=torch.float32, device="cpu")
    if factors.shape != freqs.inv_freq.shape:
        raise UnsupportedModelError(
            f"{factors.numel()} rope frequency factors for {freqs.inv_freq.numel()} frequencies"
        )
    long = None if freqs.long_inv_freq is None else freqs.long_inv_freq / factors
    return RopeFrequencies(freqs.inv_freq / factors, freqs.attention_scaling, long, freqs.long_from)


class RotaryEmbedding:
    """cos/sin tables for every position, built once at model construction (not per step)."""

    def __init__(
        self,
        config,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: str,
        layer_type: str | None = None,
    ):
        freqs = rope_frequencies(config, head_dim, layer_type)
        angles = freqs.angles(max_positions)
        self.cos = (angles.cos() * freqs.attention_scaling).to(dtype=dtype, device=device)
        self.sin = (angles.sin() * freqs.attention_scaling).to(dtype=dtype, device=device)
        self.half = head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions`, shaped [num_tokens, 1, head_dim // 2] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half (GPT-NeoX) layout, as HF Llama: x [num_tokens, heads, head_dim]."""
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
