"""Rotary position embeddings: the inverse frequencies a config asks for and the cos/sin tables built from them.

Every family reads its RoPE here (`rope_parameters` in transformers 5, `rope_theta` + `rope_scaling` before,
or one set per layer type, as Gemma 3 has), so a new scaling scheme is one function, not one per model.
"""

from __future__ import annotations

import math

import torch

from srt.model_executor.models import UnsupportedModelError

DEFAULT_ROPE_THETA = 10000.0

ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for rotary embeddings from the config (`rope_parameters` in transformers 5,
    `rope_theta` + `rope_scaling` before; per layer type where the config gives one set per type, as Gemma
    3 does), supporting the plain, linear and Llama-3.1 ("llama3") schemes."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", getattr(config, "rope_theta", DEFAULT_ROPE_THETA))
    rope_type = params.get("rope_type", params.get("type", "default"))
    # explicit CPU device: the model may be constructed under a `meta` device context
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":  # positions divided by the factor
        return inv_freq / params["factor"], 1.0
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (srt runs {', '.join(ROPE_TYPES)})"
        )
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, smoothed, scaled), 1.0


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
        inv_freq, attention_scaling = rope_inv_freq(config, head_dim, layer_type)
        t = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(t, inv_freq)
        self.cos = (freqs.cos() * attention_scaling).to(dtype=dtype, device=device)
        self.sin = (freqs.sin() * attention_scaling).to(dtype=dtype, device=device)
        self.half = head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions`, shaped [num_tokens, 1, head_dim // 2] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half (GPT-NeoX) layout, as HF Llama: x [num_tokens, heads, head_dim]."""
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
