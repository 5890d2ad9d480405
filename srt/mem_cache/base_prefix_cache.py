"""The prefix-cache interface the scheduler programs against, and the request shape it needs.

Contract (every implementation keeps it):
- KV slots returned by `match_prefix` belong to the cache. Lock the returned node with `inc_lock_ref`
  before using them, and unlock (`dec_lock_ref`) when the request no longer needs them; an unlocked
  node may be evicted, and its slots handed to someone else, at the next `evict`.
- `insert` takes ownership of the slots of the part of the key that was new; for the part already
  present it keeps its own slots and the caller must free (or keep using) its duplicates.
- `cache_finished_req` / `cache_unfinished_req` do that bookkeeping for a scheduler request: after
  them, every KV slot of the request is either owned by the cache or back in the allocator.
- Accounting: every cached token is counted in exactly one of `evictable_size` (no running request
  holds a lock on it) or `protected_size` (some request does); `total_size` is their sum.
  Used KV = allocator.size - allocator.available_size() - evictable_size().
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Req(Protocol):
    """What the cache reads and writes on a scheduler request (the scheduler's Req satisfies it)."""

    req_pool_idx: int  # its row in ReqToTokenPool
    kv_token_ids: list[
        int
    ]  # tokens whose KV is written: slots req_to_token[req_pool_idx, :len(kv_token_ids)]
    prefix_indices: torch.Tensor  # KV slots of the prefix it holds a lock on (set by the cache)
    last_node: Any  # the locked node (set by the cache; None for caches without nodes)
    lora_name: str | None  # its LoRA adapter: the cache's namespace (None: the base model)


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # int64 KV slots of the longest cached prefix (len = matched tokens)
    last_node: Any  # lock this node to keep device_indices valid


class BasePrefixCache(ABC):
    """Shares the KV of common prompt prefixes between requests; see the module docstring for the rules."""

    @abstractmethod
    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchResult:
        """Longest cached prefix of `key` computed under `namespace` (a LoRA adapter's name; None: the
        base model); marks the matched nodes as recently used."""

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, namespace: str | None = None) -> int:
        """Cache `key` with KV slots `value` under `namespace`; returns how many leading tokens were
        already present (their slots in `value` are NOT freed here)."""

    def drop_namespace(self, namespace: str) -> int:
        """Free what an unloaded adapter's namespace holds; returns the slots freed."""
        return 0

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (if possible) from unlocked leaves, least recently used
        first; returns how many were freed."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect `node` and its ancestors from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Release one lock taken by `inc_lock_ref(node)`."""

    @abstractmethod
    def cache_finished_req(self, req: Req) -> None:
        """Insert the request's tokens, free its duplicate slots, unlock its node, free its pool row."""

    @abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """Insert the tokens written so far (chunked prefill) and move the request's lock onto them,
        rewriting its req_to_token row and `prefix_indices` with the cache's slots."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> None:
        """Forget everything cached (the caller has already cleared the allocator or will)."""


def held_prefix_len(req: Req) -> int:
    """Number of leading slots of the request's row that the cache owns (its locked prefix)."""
    return 0 if req.prefix_indices is None else len(req.prefix_indices)
