"""The attention-backend interface: how a model layer attends over the paged KV pool.

Contract (every backend keeps it):
- `init_forward_metadata(batch)` is called once per forward step, before any layer runs; the backend turns
  the `ForwardBatch` into whatever index tensors it needs (gathered KV slots, masks, kernel plans) so that
  the per-layer call does no Python work proportional to the batch.
- `forward(q, k, v, layer_id, batch)` is called by each layer with this step's projected, rotated
  q `[num_tokens, num_heads, head_dim]` and k, v `[num_tokens, num_kv_heads, head_dim]`. It FIRST writes
  k and v into the KV pool at `batch.out_cache_loc` (so later steps see them), THEN returns the attention
  output `[num_tokens, num_heads * head_dim]` where each new token attends causally to every earlier token
  of its own sequence: the cached prefix (`req_to_token[req_pool_idx, :prefix_len]`) and the new tokens
  up to and including itself. Sequences never see each other's KV.
- Query head h uses KV head `h // (num_heads // num_kv_heads)` (grouped-query attention, as in HF Llama).
- Scores are scaled by `scaling` (1/sqrt(head_dim) unless the model says otherwise).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: MHATokenToKVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        device: str,
    ):
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.device = device

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-step index tensors; called once per forward step before the first layer."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """Store k/v at `batch.out_cache_loc`, then attend; returns `[num_tokens, num_heads * head_dim]`."""
