"""The one Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3) over the paged KV pool.

Architecture differences are switches read from the config, not copies of this file: Qwen2 adds a bias to
the q/k/v projections, Qwen3 RMS-normalizes q and k per head before the rotary embedding, and small models
tie the output head to the input embedding. q/k/v and gate/up are fused into one matmul each; the
checkpoint's separate tensors are copied into their slices by the declarative mapping `STACKED_PARAMS`.
The numerics follow Hugging Face's implementation op for op, so greedy outputs match it.

Tensor parallelism splits attention by heads (qkv column-parallel, o_proj row-parallel) and the MLP by
intermediate features (gate_up column-parallel, down_proj row-parallel): two all-reduces per layer. The
embedding and the output head stay replicated: for the small models this runtime serves on a CPU, the
vocabulary matmul is a small share of a step, and replicated logits need no gather before sampling, so
every rank samples the same tokens from the same numbers.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from srt.model_executor.attention.base import AttentionBackend, AttentionLayer
from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_executor.layers.activation import SiluAndMul
from srt.model_executor.layers.layernorm import RMSNorm
from srt.model_executor.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    split_size,
)
from srt.model_executor.layers.linear_method import UNQUANTIZED, LayerMethods
from srt.model_executor.layers.moe import FusedMoE
from srt.model_executor.layers.rotary_embedding import RotaryEmbedding
from srt.model_executor.models.causal_lm import CausalLM
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.unsupported import UnsupportedModelError

logger = logging.getLogger(__name__)

# (fused parameter module, checkpoint module, shard id): checkpoint tensors that land in a slice of ours.
STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


def layer_sliding_window(config, layer_id: int) -> int | None:
    """The layer's attention window: the config's `sliding_window` where `layer_types` names the layer
    `sliding_attention`, or on every layer where the config has no `layer_types` (Mistral); None otherwise
    (Qwen2 leaves `sliding_window` None unless `use_sliding_window`)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return window
    return window if layer_types[layer_id] == "sliding_attention" else None


class LlamaAttention(nn.Module):
    """This rank's heads: `num_heads` and `num_kv_heads` are per rank (the config's totals / tp size)."""

    def __init__(
        self,
        config,
        layer_id: int,
        qkv_bias: bool,
        qk_norm: bool,
        tp: TensorParallelGroup,
        methods: LayerMethods,
    ):
        super().__init__()
        self.layer_id = layer_id
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.num_heads = split_size(total_heads, tp, "num_attention_heads")
        self.num_kv_heads = split_size(total_kv_heads, tp, "num_key_value_heads")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_total, kv_total = total_heads * self.head_dim, total_kv_heads * self.head_dim
        shards = {"q": q_total, "k": kv_total, "v": kv_total}
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, shards, qkv_bias, tp, methods.linear())
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(q_total, config.hidden_size, o_bias, tp, methods.linear())
        self.attn = AttentionLayer(layer_id, self.head_dim**-0.5, layer_sliding_window(config, layer_id))
        kernels = methods.cpu_kernels
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        # q's and k's heads rotated in one kernel call, unless they are normed first (Qwen3)
        self.rope_kernels = kernels if not qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.rope_kernels is not None:
            self.rope_kernels.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *cos_sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_kernels is None:
            q, k = rope.apply(q, *cos_sin), rope.apply(k, *cos_sin)
        out = attn.forward(q, k, v.view(n, self.num_kv_heads, self.head_dim), self.attn, batch)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TensorParallelGroup, methods: LayerMethods):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported (srt runs silu)")
        inter = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        shards = {"gate": inter, "up": inter}
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, shards, bias, tp, methods.linear())
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp, methods.linear())
        self.inter = split_size(inter, tp, "intermediate_size")  # this rank's share
        self.act = SiluAndMul(self.inter, methods.cpu_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def sparse_layer(config, layer_id: int) -> bool:
    """Whether the layer's MLP is a mixture of experts: every layer of Mixtral; Qwen3-MoE's layers every
    `decoder_sparse_step`, except `mlp_only_layers`."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    if experts == 0 or layer_id in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    return (layer_id + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


def moe_mlp(config, tp: TensorParallelGroup, methods: LayerMethods) -> FusedMoE:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"experts with hidden_act {config.hidden_act!r} are not supported")
    qwen3 = hasattr(config, "moe_intermediate_size")
    return FusedMoE(
        num_experts=getattr(config, "num_local_experts", None) or config.num_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size if qwen3 else config.intermediate_size,
        renormalize=bool(config.norm_topk_prob) if qwen3 else True,
        weights_in_model_dtype=qwen3,
        tp=tp,
        method=methods.linear(),
    )


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, qkv_bias: bool, qk_norm: bool, tp, methods: LayerMethods):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, qk_norm, tp, methods)
        sparse = sparse_layer(config, layer_id)
        self.mlp = moe_mlp(config, tp, methods) if sparse else LlamaMLP(config, tp, methods)
        eps, kernels = config.rms_norm_eps, methods.cpu_kernels
        self.input_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, kernels)

    def forward(self, hidden, rope, cos_sin, batch, attn) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, cos_sin, batch, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, methods: LayerMethods):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, qk_norm, tp, methods)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, methods.cpu_kernels)


class LlamaForCausalLM(CausalLM):
    STACKED_PARAMS = STACKED_PARAMS
    # the fused CPU decode step (cpu_decode.py) is written for these layers
    CPU_DECODE = True
    # architecture name -> (qkv_bias, qk_norm)
    ARCH_SWITCHES = {
        "LlamaForCausalLM": (False, False),
        "MistralForCausalLM": (False, False),
        "MixtralForCausalLM": (False, False),
        "Qwen2ForCausalLM": (True, False),
        "Qwen3ForCausalLM": (False, True),
        "Qwen3MoeForCausalLM": (False, True),
    }
    # checkpoint names of the experts' tensors -> (our parameter, shard): Mixtral's w1/w3/w2 and router under
    # `block_sparse_moe`, Qwen3-MoE's gate/up/down under `mlp`; expert tensors load into stacked parameters
    EXPERT_PARAMS: tuple[tuple[str, str, str], ...] = (
        (r"\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(?:w1|gate_proj)\.weight$", ".mlp.w13", "gate"),
        (r"\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(?:w3|up_proj)\.weight$", ".mlp.w13", "up"),
        (r"\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(?:w2|down_proj)\.weight$", ".mlp.w2", "down"),
    )
    RENAMES: tuple[tuple[str, str], ...] = ((".block_sparse_moe.gate.", ".mlp.gate."),)

    def __init__(
        self,
        config,
        arch: str,
        max_positions: int,
        dtype: torch.dtype,
        device: str,
        tp: TensorParallelGroup | None = None,
        methods: LayerMethods = UNQUANTIZED,
    ):
        super().__init__()
        qkv_bias, qk_norm = self.ARCH_SWITCHES[arch]
        qkv_bias = qkv_bias or bool(getattr(config, "attention_bias", False))
        self.config = config
        self.kernels = methods.cpu_kernels
        self.model = LlamaModel(config, qkv_bias, qk_norm, tp or TensorParallelGroup(), methods)
        self.build_head(config, methods, tie_by_default=False)
        # set by the model runner once the KV pool exists (the pool is sized after the weights are loaded)
        self.attn_backend: AttentionBackend | None = None
        head_dim = self.model.layers[0].self_attn.head_dim
        self.rope = RotaryEmbedding(config, head_dim, max_positions, dtype, device)

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        if self.cpu_decode is not None and self.cpu_decode.takes(batch):
            return self.cpu_decode.hidden_states(input_ids, positions, batch)
        hidden = self.model.embed_tokens(input_ids)
        cos_sin = self.rope.tables(positions)
        for layer in self.model.layers:
            hidden = layer(hidden, self.rope, cos_sin, batch, self.attn_backend)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()


EntryClass = LlamaForCausalLM
