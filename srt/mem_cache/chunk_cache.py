"""The cache behind --disable-radix-cache: never shares, so every request computes its whole prompt.

It still implements `cache_unfinished_req` so chunked prefill works the same way with or without
sharing: the request's own slots so far become its "prefix" for the next chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, Req
from srt.mem_cache.memory_pool import INDEX_DTYPE, ReqToTokenPool, TokenToKVPoolAllocator


class ChunkCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: TokenToKVPoolAllocator):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self._empty = torch.empty(0, dtype=INDEX_DTYPE, device=token_to_kv_pool_allocator.device)

    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchResult:
        return MatchResult(device_indices=self._empty, last_node=None)

    def insert(self, key: list[int], value: torch.Tensor, namespace: str | None = None) -> int:
        """Nothing is kept, so nothing was ever present."""
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def cache_finished_req(self, req: Req) -> None:
        row = req.req_pool_idx
        self.token_to_kv_pool_allocator.free(
            self.req_to_token_pool.req_to_token[row, : len(req.kv_token_ids)]
        )
        self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req: Req) -> None:
        row = req.req_pool_idx
        req.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(req.kv_token_ids)].clone()
        req.last_node = None

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
