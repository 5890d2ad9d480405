"""Gemma 2 and Gemma 3 (text) over the paged KV pool: one family with switches, like `llama.py`.

What sets the family apart from Llama, each as in Hugging Face's implementation: embeddings scaled by
sqrt(hidden_size) (in the model's dtype); RMSNorm that multiplies by (1 + w) in fp32; four norms per layer
(around attention and around the MLP, both outputs normed before the residual add); a GeGLU MLP
(gelu-tanh); scores scaled by `query_pre_attn_scalar`^-0.5; layers that alternate between sliding-window
and full attention (`layer_types`); tied embeddings. Gemma 2 soft-caps attention scores and the final
logits with tanh; Gemma 3 instead RMS-normalizes q and k per head and gives its sliding-window layers their
own RoPE base (`rope_parameters` per layer type).

The q/k/v and gate/up checkpoint tensors load into fused matmuls through the same `STACKED_PARAMS` as
Llama's; tensor parallelism splits heads and MLP features the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.model_executor.attention.base import AttentionBackend, AttentionLayer
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_executor.layers.cpu_kernels import CpuKernels
from srt.model_executor.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    split_size,
)
from srt.model_executor.layers.linear_method import UNQUANTIZED, LayerMethods
from srt.model_executor.layers.rotary_embedding import RotaryEmbedding
from srt.model_executor.models.causal_lm import CausalLM
from srt.model_executor.models.llama import STACKED_PARAMS, layer_sliding_window
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.unsupported import UnsupportedModelError

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), computed in fp32 and cast back (Gemma's order: scale before the cast). With the
    int8 model's CPU kernels, one RMSNorm kernel call with the weight 1 + w, formed at the first call (the
    weights are final by then: loading precedes any forward)."""

    def __init__(self, dim: int, eps: float, kernels: CpuKernels | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.kernels = kernels
        self._kernel_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            if self._kernel_weight is None:
                self._kernel_weight = (1.0 + self.weight.float()).contiguous()
            return self.kernels.rmsnorm(x, self._kernel_weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def layer_type(config, layer_id: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    return layer_types[layer_id] if layer_types else FULL


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_id: int, qk_norm: bool, tp: TensorParallelGroup, methods: LayerMethods):
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_heads = split_size(total_heads, tp, "num_attention_heads")
        self.num_kv_heads = split_size(total_kv_heads, tp, "num_key_value_heads")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_total, kv_total = total_heads * self.head_dim, total_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, {"q": q_total, "k": kv_total, "v": kv_total}, bias, tp, methods.linear()
        )
        self.o_proj = RowParallelLinear(q_total, config.hidden_size, bias, tp, methods.linear())
        kernels = methods.cpu_kernels
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.rope_kernels = kernels
        self.rope_key = layer_type(config, layer_id)
        self.attn = AttentionLayer(
            layer_id,
            config.query_pre_attn_scalar**-0.5,
            layer_sliding_window(config, layer_id),
            getattr(config, "attn_logit_softcapping", None) or None,
        )

    def forward(self, hidden, rope: RotaryEmbedding, cos_sin, batch: ForwardBatch, attn: AttentionBackend):
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, rope, cos_sin), self._rotate(k, rope, cos_sin)
        out = attn.forward(q, k, v.view(n, self.num_kv_heads, self.head_dim), self.attn, batch)
        return self.o_proj(out)

    def _rotate(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin) -> torch.Tensor:
        """x [n, heads, head_dim] rotated: by the CPU kernel in place on a contiguous copy (or x itself, once
        normed), else by the table's PyTorch ops."""
        if self.rope_kernels is None:
            return rope.apply(x, *cos_sin)
        rows = x.reshape(x.shape[0], -1)
        self.rope_kernels.rope_(rows, x.shape[1], self.head_dim, *cos_sin)
        return rows.view_as(x)


class GemmaMLP(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup, methods: LayerMethods):
        super().__init__()
        if config.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"hidden_activation {config.hidden_activation!r} is not supported")
        inter = config.intermediate_size
        shards = {"gate": inter, "up": inter}
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, shards, False, tp, methods.linear())
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, tp, methods.linear())
        self.inter = split_size(inter, tp, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, qk_norm: bool, tp: TensorParallelGroup, methods: LayerMethods):
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_id, qk_norm, tp, methods)
        self.mlp = GemmaMLP(config, tp, methods)
        eps, kernels, hidden = config.rms_norm_eps, methods.cpu_kernels, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(hidden, eps, kernels)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, kernels)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, kernels)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, kernels)

    def forward(self, hidden, rope, cos_sin, batch, attn) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rope, cos_sin, batch, attn)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    def __init__(self, config, qk_norm: bool, tp: TensorParallelGroup, methods: LayerMethods):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, qk_norm, tp, methods) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, methods.cpu_kernels)


class GemmaForCausalLM(CausalLM):
    # architecture name -> qk_norm
    ARCH_SWITCHES = {"Gemma2ForCausalLM": False, "Gemma3ForCausalLM": True}
    STACKED_PARAMS = STACKED_PARAMS

    def __init__(
        self,
        config,
        arch: str,
        max_positions: int,
        dtype: torch.dtype,
        device: str,
        tp=None,
        methods: LayerMethods = UNQUANTIZED,
    ):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("use_bidirectional_attention (an embedding model) is not supported")
        self.config = config
        self.kernels = methods.cpu_kernels  # norms, rotary embedding and attention; GeGLU has no fused form
        self.model = GemmaModel(config, self.ARCH_SWITCHES[arch], tp or TensorParallelGroup(), methods)
        self.build_head(config, methods, tie_by_default=True)
        self.final_logit_cap = getattr(config, "final_logit_softcapping", None) or None
        self.attn_backend: AttentionBackend | None = None
        # one RoPE table per layer type whose parameters differ (Gemma 3: a local and a global base)
        keys = sorted({layer.self_attn.rope_key for layer in self.model.layers})
        self.ropes = {
            key: RotaryEmbedding(config, config.head_dim, max_positions, dtype, device, layer_type=key)
            for key in keys
        }
        # HF multiplies by sqrt(hidden) cast to the model's dtype (55.4256 becomes 55.5 in bf16)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype, device="cpu").item()

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids) * self.embed_scale
        tables = {key: rope.tables(positions) for key, rope in self.ropes.items()}
        for layer in self.model.layers:
            key = layer.self_attn.rope_key
            hidden = layer(hidden, self.ropes[key], tables[key], batch, self.attn_backend)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(hidden)).float()
        if self.final_logit_cap is not None:
            logits = torch.tanh(logits / self.final_logit_cap) * self.final_logit_cap
        return logits
