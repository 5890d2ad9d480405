"""The attention-backend interface: how a model layer attends over the paged KV pool.

Contract (every backend keeps it):
- `init_forward_metadata(batch)` is called once per forward step, before any layer runs; the backend turns
  the `ForwardBatch` into whatever index tensors it needs (gathered KV slots, masks, kernel plans) so that
  the per-layer call does no Python work proportional to the batch.
- `forward(q, k, v, layer, batch)` is called by each layer with its `AttentionLayer` and this step's
  projected, rotated
  q `[num_tokens, num_heads, head_dim]` and k, v `[num_tokens, num_kv_heads, head_dim]`. It FIRST writes
  k and v into the KV pool at `batch.out_cache_loc` (so later steps see them), THEN returns the attention
  output `[num_tokens, num_heads * head_dim]` where each new token attends causally to every earlier token
  of its own sequence: the cached prefix (`req_to_token[req_pool_idx, :prefix_len]`) and the new tokens
  up to and including itself. Sequences never see each other's KV.
- Query head h uses KV head `h // (num_heads // num_kv_heads)` (grouped-query attention, as in HF Llama).
- A layer's parameters travel with the call (`AttentionLayer`), since layers of one model differ: scores
  are scaled by `layer.scaling`, capped by `layer.logit_cap` (cap * tanh(score / cap)) when set, and with
  `layer.sliding_window` W a token attends only to the keys of the W positions ending at its own.
- `unsupported(layer)` says why the backend cannot run a layer (None when it can): the runner asks for
  every layer at start-up, so a model the backend cannot run is a start-up error, never a wrong answer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass(frozen=True)
class AttentionLayer:
    """One layer's attention parameters."""

    layer_id: int
    scaling: float  # multiplies q.k (1/sqrt(head_dim) unless the model says otherwise)
    sliding_window: int | None = None  # attend to the keys of the last W positions, the token's own included
    logit_cap: float | None = None  # soft-cap the scaled scores: cap * tanh(score / cap)


@dataclass(frozen=True)
class KVLayout:
    """What a model's attention needs from the KV pool and a backend, for this rank's share of the heads."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class AttentionBackend(ABC):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: MHATokenToKVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: str,
        cpu_kernels=None,
    ):
        """`cpu_kernels`: the int8 model's fused CPU kernels (`layers/cpu_kernels.py`), which a CPU backend
        attends through where given; GPU backends take none."""
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self.cpu_kernels = cpu_kernels

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-step index tensors; called once per forward step before the first layer."""

    def unsupported(self, layer: AttentionLayer) -> str | None:
        """Why this backend cannot run `layer`; None when it can. Plain full attention runs everywhere."""
        if layer.sliding_window is not None:
            return "sliding-window attention"
        if layer.logit_cap is not None:
            return "attention logit soft-capping"
        return None

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """Store k/v at `batch.out_cache_loc`, then attend; returns `[num_tokens, num_heads * head_dim]`."""
