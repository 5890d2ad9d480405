"""What the runner, the loader and the quantizer read of a model, written once for every family.

A family's class derives from `CausalLM`, holds `model.embed_tokens`, `model.layers` (each with
`self_attn.attn`, its `AttentionLayer`) and `lm_head` (a `ReplicatedLinear`, reading the embedding when
tied), is built with `LayerMethods` (its layers' linear method and fused kernels), and implements
`hidden_states` and `compute_logits`; the rest of the interface (the KV layout, the attention layers, the
input embedding, the last-token forward, which checkpoint tensors to skip, `ready`) is the same for all of
them. Code outside `models/` reads a model through this interface only.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.model_executor.attention.base import AttentionLayer, KVLayout
from srt.model_executor.forward_batch_info import ForwardBatch, last_token_rows
from srt.model_executor.layers.cpu_kernels import CpuKernels
from srt.model_executor.layers.linear import ReplicatedLinear
from srt.model_executor.layers.linear_method import LayerMethods
from srt.model_executor.models.cpu_decode import CpuDecodeStep

# Checkpoint tensors recomputed instead of loaded.
IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


class CausalLM(nn.Module):
    """Model code takes (input_ids, positions, forward_batch) and returns the logits of each sequence's last
    new token; the head runs only on those rows (most of an extend step's rows are never sampled)."""

    model: nn.Module
    lm_head: nn.Module
    tie_word_embeddings: bool
    kernels: CpuKernels | None = None  # the fused CPU kernels the layers were built with
    # whether the fused CPU decode step (cpu_decode.py) is written for this family's layers
    CPU_DECODE = False
    # the int8 CPU decode step as one kernel call per operation, built in `ready` where it applies
    cpu_decode: CpuDecodeStep | None = None
    # the checkpoint name of the input embedding table, which the runner may map instead of copying
    EMBEDDING_WEIGHT = "model.embed_tokens.weight"

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Last layer's output for every token of the step (before the final norm)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the given rows of `hidden_states`."""
        raise NotImplementedError

    def final_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 final-norm output of the given rows of `hidden_states`: the head's input, and what transformers'
        base model returns as `last_hidden_state`, which an embedding server pools (--is-embedding)."""
        return self.model.norm(hidden).float()

    @property
    def kv_layout(self) -> KVLayout:
        a = self.model.layers[0].self_attn
        return KVLayout(len(self.model.layers), a.num_heads, a.num_kv_heads, a.head_dim)

    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def build_head(self, config, methods: LayerMethods, tie_by_default: bool) -> None:
        """The output head, a linear layer with the model's method, reading the input embedding when the
        config ties the two (`tie_by_default` where it does not say). Called once `model.embed_tokens` exists."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tie_by_default))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, methods.linear(), tied)

    @property
    def input_embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def ready(self) -> None:
        """Called once the weights are final (quantized, if they are) and the attention backend is set:
        builds what depends on both, the fused CPU decode step, which refuses (once, in the log) a model
        it cannot run."""
        self.cpu_decode = CpuDecodeStep.build(self, self.kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions, batch)
        if not batch.is_decode:
            hidden = hidden[last_token_rows(batch.new_token_counts(), hidden.device)]
        return self.compute_logits(hidden)

    # ---- declarative weight loading (used by model_loader) ----
    def skip_weight(self, name: str) -> bool:
        if name.endswith(IGNORED_WEIGHT_SUFFIXES):
            return True
        return self.tie_word_embeddings and name.startswith("lm_head.")
