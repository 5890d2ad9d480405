"""Radix tree over token ids whose nodes own the KV slots of their tokens (page size 1).

Invariants:
- A node's `key` (token ids) and `value` (KV slots) have equal length; children are keyed by the first
  token of their key, so no two children of a node start with the same token.
- `lock_ref` of a node counts the requests using it or a descendant; the root is always locked.
- Every non-root token is counted in `evictable_size` when its node's lock_ref is 0, else in
  `protected_size`. Splitting a node keeps its lock_ref on both halves, so sizes do not change.
- A node's `start` is the position of its first token in the sequence (the sum of its ancestors' key
  lengths).

Namespaces: requests of a LoRA adapter compute other KV for the same tokens than the base model, so each
adapter's prefixes live in a tree of their own (`namespace`: the adapter's name; None: the base model),
under its own root. Roots have no parent; eviction, locking and the sizes span every tree.

KV cache events (optional `kv_events` sink, see kv_events.py): the cached set is reported in blocks of
`block_size` tokens; a node keeps the digests of the blocks whose last token it holds. A new leaf publishes
`BlockStored` for its blocks, an evicted leaf `BlockRemoved`, `reset` `AllBlocksCleared`. A split changes
which node owns a block but not which blocks are cached, so it publishes nothing: it only divides the
digests between the two halves. Hence the blocks a subscriber has seen stored and not removed are always
exactly the full blocks on the tree's paths.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Protocol

import torch

from srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult, Req, held_prefix_len
from srt.mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventSink,
    adapter_id,
    adapter_seed,
    block_id,
    chain_digests,
)
from srt.mem_cache.memory_pool import INDEX_DTYPE, ReqToTokenPool, TokenToKVPoolAllocator

ROOT_NODE_ID = 0


class ResidencyObserver(Protocol):
    """Optional listener for --kv-cache-metrics; `now` is time.monotonic()."""

    def node_created(self, node_id: int, now: float) -> None: ...
    def node_hit(self, node_id: int, now: float) -> None: ...
    def node_evicted(self, node_id: int, now: float) -> None: ...


class TreeNode:
    __slots__ = (
        "id",
        "key",
        "value",
        "parent",
        "children",
        "lock_ref",
        "last_access_time",
        "created_at",
        "start",
        "block_digests",
    )

    def __init__(
        self,
        node_id: int,
        key: list[int],
        value: torch.Tensor,
        parent: TreeNode | None,
        now: float,
        start: int = 0,
    ):
        self.id = node_id
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.last_access_time = now
        self.created_at = now
        self.start = start
        # digests of the event blocks ending in this node; stays empty unless KV events are on
        self.block_digests: list[bytes] | tuple = ()

    def __lt__(self, other: TreeNode) -> bool:
        """Heap order for eviction: least recently used first, older node on ties."""
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache(BasePrefixCache):
    """Shares KV across requests with a common token prefix; evicts unlocked leaves in LRU order."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        residency_observer: ResidencyObserver | None = None,
        kv_events: KVEventSink | None = None,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.residency_observer = residency_observer
        self.kv_events = kv_events
        self.device = token_to_kv_pool_allocator.device
        self.reset()

    # ---- public API -------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop the whole tree without freeing slots (the caller clears the allocator with it)."""
        self._ids = itertools.count(ROOT_NODE_ID + 1)
        self.root = TreeNode(ROOT_NODE_ID, [], self._empty(), None, time.monotonic())
        self.root.lock_ref = 1
        self.roots: dict[str | None, TreeNode] = {None: self.root}  # by namespace (see the docstring)
        self._namespace_of: dict[int, str | None] = {ROOT_NODE_ID: None}  # root id -> its namespace
        self._evictable_size = 0
        self._protected_size = 0
        if self.kv_events is not None:
            self.kv_events.publish(AllBlocksCleared())

    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchResult:
        now = time.monotonic()
        observer = self.residency_observer
        node = self.roots.get(namespace)
        if node is None:
            return MatchResult(device_indices=self._empty(), last_node=self.root)
        node.last_access_time = now
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(key[0])
            if child is None:
                break
            matched = _common_prefix_len(child.key, key)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access_time = now
            if observer is not None:
                observer.node_hit(child.id, now)
            values.append(child.value)
            node = child
            key = key[matched:]
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(device_indices=indices, last_node=node)

    def insert(self, key: list[int], value: torch.Tensor, namespace: str | None = None) -> int:
        now = time.monotonic()
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = TreeNode(next(self._ids), [], self._empty(), None, now)
            node.lock_ref = 1
            self._namespace_of[node.id] = namespace
        node.last_access_time = now
        present = 0
        full_key = key
        while key:
            child = node.children.get(key[0])
            if child is None:
                leaf = self._add_leaf(node, key, value, now, start=present)
                if self.kv_events is not None:
                    self._publish_stored(leaf, full_key)
                break
            matched = _common_prefix_len(child.key, key)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access_time = now
            present += matched
            node = child
            key = key[matched:]
            value = value[matched:]
        return present

    def evict(self, num_tokens: int) -> int:
        leaves = [
            n for n in self._iter_nodes() if not n.children and n.lock_ref == 0 and n.parent is not None
        ]
        heapq.heapify(leaves)
        freed = 0
        observer = self.residency_observer
        now = time.monotonic() if observer is not None else 0.0
        removed: list[int] = []
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.token_to_kv_pool_allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if observer is not None:
                observer.node_evicted(leaf.id, now)
            if leaf.block_digests:
                removed.extend(block_id(d) for d in leaf.block_digests)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        if removed:
            self.kv_events.publish(BlockRemoved(removed))
        return freed

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"radix node {node.id} unlocked more often than locked")
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def cache_finished_req(self, req: Req) -> None:
        row = req.req_pool_idx
        kv_indices = self.req_to_token_pool.req_to_token[row, : len(req.kv_token_ids)].clone()
        self._insert_and_free_duplicates(req, kv_indices)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req: Req) -> None:
        row = req.req_pool_idx
        token_ids = req.kv_token_ids
        kv_indices = self.req_to_token_pool.req_to_token[row, : len(token_ids)].clone()
        held = self._insert_and_free_duplicates(req, kv_indices)
        match = self.match_prefix(token_ids, req.lora_name)
        new_indices = match.device_indices
        # The tree's slots replace the duplicates just freed, so the row stays valid for attention.
        self.req_to_token_pool.write((row, slice(held, len(new_indices))), new_indices[held:])
        self.inc_lock_ref(match.last_node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = match.last_node

    def drop_namespace(self, namespace: str) -> int:
        """Free every slot an adapter's tree holds (it was unloaded: an adapter loaded later under the same
        name may have other weights). No request of it may be running. Returns the slots freed."""
        root = self.roots.pop(namespace, None)
        if root is None:
            return 0
        del self._namespace_of[root.id]
        nodes = [n for n in _subtree(root) if n is not root]
        if any(n.lock_ref for n in nodes):
            raise RuntimeError(f"adapter {namespace!r} still has running requests in the prefix cache")
        freed = 0
        removed: list[int] = []
        now = time.monotonic()
        for node in nodes:
            self.token_to_kv_pool_allocator.free(node.value)
            freed += len(node.key)
            if self.residency_observer is not None:
                self.residency_observer.node_evicted(node.id, now)
            removed.extend(block_id(d) for d in node.block_digests)
        self._evictable_size -= freed
        if removed:
            self.kv_events.publish(BlockRemoved(removed))
        return freed

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    # ---- internals --------------------------------------------------------------------------------

    def _insert_and_free_duplicates(self, req: Req, kv_indices: torch.Tensor) -> int:
        """Insert the request's tokens and free the slots the tree already had for them.

        The request's first `held` slots came from its own match and already are the tree's: they are
        not duplicates. Returns `held`.
        """
        held = held_prefix_len(req)
        present = self.insert(req.kv_token_ids, kv_indices, req.lora_name)
        if present > held:
            self.token_to_kv_pool_allocator.free(kv_indices[held:present])
        return held

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, now: float, start: int
    ) -> TreeNode:
        leaf = TreeNode(next(self._ids), list(key), value.clone(), parent, now, start)
        parent.children[key[0]] = leaf
        self._evictable_size += len(key)
        if self.residency_observer is not None:
            self.residency_observer.node_created(leaf.id, now)
        return leaf

    def _publish_stored(self, leaf: TreeNode, path_key: list[int]) -> None:
        """Publish the blocks whose last token is in the new `leaf`; `path_key` is the inserted key, from
        the root, so it also holds the tokens of a first block that begins in an ancestor."""
        size = self.kv_events.block_size
        first, end = leaf.start // size, (leaf.start + len(leaf.key)) // size
        if first == end:
            return
        # The block before `first` ends at or before leaf.start: it is the last block of the nearest
        # ancestor that owns any (a root owns none; an adapter's chain starts from its seed).
        owner = leaf.parent
        while owner.parent is not None and not owner.block_digests:
            owner = owner.parent
        parent_digest = owner.block_digests[-1] if owner.block_digests else None
        root = owner
        while root.parent is not None:
            root = root.parent
        adapter = self._namespace_of[root.id]
        chain_from = parent_digest if parent_digest is not None or adapter is None else adapter_seed(adapter)
        tokens = path_key[first * size : end * size]
        leaf.block_digests = chain_digests(chain_from, tokens, size)
        self.kv_events.publish(
            BlockStored(
                block_hashes=[block_id(d) for d in leaf.block_digests],
                parent_block_hash=None if parent_digest is None else block_id(parent_digest),
                token_ids=tokens,
                block_size=size,
                lora_id=None if adapter is None else adapter_id(adapter),
                lora_name=adapter,
            )
        )

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` after `at` tokens; returns the new parent holding the first `at` tokens.

        The new node inherits the lock count, access time and creation time (its tokens entered the
        cache with the original), so neither sizes nor residency nor the cached blocks change.
        """
        head = TreeNode(
            next(self._ids), node.key[:at], node.value[:at], node.parent, node.created_at, node.start
        )
        head.lock_ref = node.lock_ref
        head.last_access_time = node.last_access_time
        node.parent.children[head.key[0]] = head
        node.key = node.key[at:]
        node.value = node.value[at:]
        node.parent = head
        node.start += at
        if node.block_digests:  # the blocks ending in the head move to it; the cached set is unchanged
            size = self.kv_events.block_size
            n = node.start // size - head.start // size
            head.block_digests, node.block_digests = node.block_digests[:n], node.block_digests[n:]
        head.children[node.key[0]] = node
        if self.residency_observer is not None:
            self.residency_observer.node_created(head.id, head.created_at)
        return head

    def _iter_nodes(self):
        for root in list(self.roots.values()):
            yield from _subtree(root)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=INDEX_DTYPE, device=self.device)


def _subtree(node: TreeNode):
    stack = [node]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
