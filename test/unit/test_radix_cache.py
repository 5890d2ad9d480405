"""Specification of the prefix caches: radix tree matching, splitting, locking, LRU eviction, the
request bookkeeping of cache_finished_req / cache_unfinished_req, and the no-sharing ChunkCache."""

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from srt.mem_cache import radix_cache as radix_module
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from srt.mem_cache.radix_cache import RadixCache, TreeNode

KV_SLOTS = 64
REQ_ROWS = 8
CONTEXT_LEN = 32


@dataclass
class FakeReq:
    req_pool_idx: int
    kv_token_ids: list[int]
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    lora_name: str | None = None


@pytest.fixture(autouse=True)
def ticking_clock(monkeypatch):
    """Each clock read is one tick later, so LRU order is exactly the order of operations."""
    ticks = itertools.count(1)
    monkeypatch.setattr(radix_module.time, "monotonic", lambda: float(next(ticks)))


@pytest.fixture
def pools():
    return ReqToTokenPool(REQ_ROWS, CONTEXT_LEN), TokenToKVPoolAllocator(KV_SLOTS)


@pytest.fixture
def cache(pools):
    return RadixCache(*pools)


def insert_new(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert `key` with freshly allocated slots, freeing the ones the tree already had (as a caller must)."""
    value = cache.token_to_kv_pool_allocator.alloc(len(key))
    present = cache.insert(key, value)
    cache.token_to_kv_pool_allocator.free(value[:present])
    return value


def start_req(cache: RadixCache, pools, tokens: list[int]) -> FakeReq:
    """What the scheduler does at admission: match, lock, and allocate KV for the unmatched rest."""
    req_pool, allocator = pools
    row = req_pool.alloc(1)[0]
    match = cache.match_prefix(tokens)
    cache.inc_lock_ref(match.last_node)
    held = len(match.device_indices)
    new = allocator.alloc(len(tokens) - held)
    assert new is not None
    req_pool.req_to_token[row, :held] = match.device_indices
    req_pool.req_to_token[row, held : len(tokens)] = new
    return FakeReq(row, list(tokens), match.device_indices, match.last_node)


def nodes(cache: RadixCache) -> list[TreeNode]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


# ---- matching and insertion ---------------------------------------------------------------------------


def test_empty_cache_matches_nothing(cache):
    match = cache.match_prefix([1, 2, 3])
    assert match.device_indices.numel() == 0
    assert match.device_indices.dtype == torch.int64
    assert match.last_node is cache.root


def test_match_returns_slots_of_longest_cached_prefix(cache):
    value = insert_new(cache, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == value.tolist()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == value.tolist()
    assert cache.match_prefix([9, 1, 2]).device_indices.numel() == 0


def test_match_ending_mid_node_splits_it(cache):
    value = insert_new(cache, [1, 2, 3, 4])
    match = cache.match_prefix([1, 2, 7])
    assert match.device_indices.tolist() == value[:2].tolist()
    assert match.last_node.key == [1, 2]
    (tail,) = match.last_node.children.values()
    assert tail.key == [3, 4] and tail.value.tolist() == value[2:].tolist()
    assert cache.root.children[1] is match.last_node
    assert cache.total_size() == 4, "splitting does not change the cached token count"


def test_insert_returns_length_already_present_and_splits_on_divergence(cache):
    first = insert_new(cache, [1, 2, 3, 4])
    second = cache.token_to_kv_pool_allocator.alloc(5)
    assert cache.insert([1, 2, 5, 6, 7], second) == 2
    head = cache.root.children[1]
    assert head.key == [1, 2]
    assert sorted(head.children) == [3, 5]
    assert head.children[5].value.tolist() == second[2:].tolist()
    assert (
        cache.match_prefix([1, 2, 5, 6, 7]).device_indices.tolist()
        == first[:2].tolist() + second[2:].tolist()
    )
    assert cache.total_size() == 7


def test_insert_of_a_prefix_of_a_cached_key_adds_nothing(cache):
    insert_new(cache, [1, 2, 3, 4])
    assert cache.insert([1, 2], torch.tensor([50, 51])) == 2
    assert cache.total_size() == 4
    assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0


# ---- locking and eviction -------------------------------------------------------------------------------


def test_lock_moves_tokens_from_evictable_to_protected_along_the_path(cache):
    insert_new(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4, 5]).last_node
    insert_new(cache, [1, 2, 9])  # splits [1,2,3,4] into [1,2] + [3,4]
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    cache.inc_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)


def test_unlocking_more_than_locked_is_an_error(cache):
    insert_new(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)


def test_evict_frees_least_recently_used_leaf_first(cache):
    allocator = cache.token_to_kv_pool_allocator
    insert_new(cache, [1, 1])
    insert_new(cache, [2, 2])
    insert_new(cache, [3, 3])
    cache.match_prefix([1, 1])  # [2, 2] is now the least recently used
    before = allocator.available_size()
    assert cache.evict(1) == 2
    assert allocator.available_size() == before + 2
    assert cache.match_prefix([2, 2]).device_indices.numel() == 0
    assert len(cache.match_prefix([1, 1]).device_indices) == 2
    assert len(cache.match_prefix([3, 3]).device_indices) == 2


def test_evict_never_frees_a_locked_node_or_its_ancestors(cache):
    insert_new(cache, [1, 2, 3])
    insert_new(cache, [1, 2, 4])
    insert_new(cache, [5, 6])
    locked = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(locked)
    freed = cache.evict(KV_SLOTS)
    assert freed == 3, "only [1,2,4]'s leaf and [5,6] are evictable"
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 3
    assert (cache.evictable_size(), cache.protected_size()) == (0, 3)


def test_evicting_a_leaf_makes_its_parent_evictable_in_the_same_call(cache):
    allocator = cache.token_to_kv_pool_allocator
    insert_new(cache, [1, 2, 3])
    insert_new(cache, [1, 2, 4])
    assert cache.evict(4) == 4
    assert cache.total_size() == 0
    assert allocator.available_size() == KV_SLOTS
    assert not cache.root.children


def test_evict_stops_once_enough_is_freed(cache):
    for t in range(5):
        insert_new(cache, [t, t, t])
    assert cache.evict(4) == 6
    assert cache.total_size() == 9


# ---- request bookkeeping -------------------------------------------------------------------------------


def test_finished_req_without_match_frees_exactly_the_slots_already_cached(cache, pools):
    req_pool, allocator = pools
    a = start_req(cache, pools, [1, 2, 3, 4])
    b = start_req(cache, pools, [1, 2, 3, 4, 5, 6])  # started before a finished: no sharing
    assert allocator.available_size() == KV_SLOTS - 10
    cache.cache_finished_req(a)
    assert allocator.available_size() == KV_SLOTS - 10, "a's slots now belong to the tree"
    cache.cache_finished_req(b)
    assert allocator.available_size() == KV_SLOTS - 6, "b's 4 duplicate slots were freed"
    assert cache.total_size() == 6 and cache.protected_size() == 0
    assert req_pool.available_size() == REQ_ROWS
    assert allocator.available_size() + cache.total_size() == KV_SLOTS


def test_finished_req_never_frees_its_matched_prefix(cache, pools):
    req_pool, allocator = pools
    cache.cache_finished_req(start_req(cache, pools, [1, 2, 3]))
    req = start_req(cache, pools, [1, 2, 3, 7, 8])
    assert len(req.prefix_indices) == 3
    assert cache.protected_size() == 3
    cache.cache_finished_req(req)
    assert allocator.available_size() + cache.total_size() == KV_SLOTS
    assert cache.total_size() == 5 and cache.protected_size() == 0
    assert req_pool.available_size() == REQ_ROWS


def test_finished_req_frees_duplicates_beyond_its_own_prefix(cache, pools):
    _, allocator = pools
    cache.cache_finished_req(start_req(cache, pools, [1, 2]))
    a = start_req(cache, pools, [1, 2, 3, 4, 5])  # holds [1, 2]
    b = start_req(cache, pools, [1, 2, 3, 4, 5, 6])  # holds [1, 2] too
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)  # [3, 4, 5] of b are duplicates of a's
    assert cache.total_size() == 6
    assert allocator.available_size() + cache.total_size() == KV_SLOTS


def test_unfinished_req_moves_its_lock_and_rewrites_its_row_with_tree_slots(cache, pools):
    req_pool, allocator = pools
    other = start_req(cache, pools, [1, 2, 3, 4])
    cache.cache_finished_req(other)
    req = start_req(cache, pools, [1, 2])  # first chunk of a longer prompt, matched [1, 2]
    old_node = req.last_node
    # second chunk written into fresh slots, duplicating the tree's [3, 4]
    extra = allocator.alloc(3)
    req_pool.req_to_token[req.req_pool_idx, 2:5] = extra
    req.kv_token_ids = [1, 2, 3, 4, 9]
    cache.cache_unfinished_req(req)

    tree_slots = cache.match_prefix([1, 2, 3, 4, 9]).device_indices
    assert req.prefix_indices.tolist() == tree_slots.tolist()
    assert req_pool.req_to_token[req.req_pool_idx, :5].tolist() == tree_slots.tolist()
    assert req.last_node is not old_node and req.last_node.key == [9]
    assert cache.protected_size() == 5 and cache.evictable_size() == 0
    assert allocator.available_size() + cache.total_size() == KV_SLOTS, "duplicates of [3, 4] were freed"

    cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    assert allocator.available_size() + cache.total_size() == KV_SLOTS
    assert req_pool.available_size() == REQ_ROWS


def test_random_operations_keep_sizes_and_slot_ownership_consistent(cache, pools):
    """Admit, extend (chunked prefill / decode), finish and evict at random; after every step the
    tree's sizes match a recount and every KV slot is in exactly one place."""
    req_pool, allocator = pools
    rng = random.Random(1234)
    live: list[FakeReq] = []
    alphabet = [1, 2, 3]

    def check():
        tree = [n for n in nodes(cache) if n is not cache.root]
        assert cache.evictable_size() == sum(len(n.key) for n in tree if n.lock_ref == 0)
        assert cache.protected_size() == sum(len(n.key) for n in tree if n.lock_ref > 0)
        for n in tree:
            assert len(n.key) == len(n.value) > 0
            assert n.lock_ref >= 0
            assert n.parent.children[n.key[0]] is n
            assert all(c.lock_ref <= n.lock_ref for c in n.children.values())
        owned = [s for n in tree for s in n.value.tolist()]
        for r in live:
            held = len(r.prefix_indices)
            owned += req_pool.req_to_token[r.req_pool_idx, held : len(r.kv_token_ids)].tolist()
        assert len(owned) == len(set(owned)), "a KV slot is owned twice"
        assert 0 not in owned
        assert len(owned) + allocator.available_size() == KV_SLOTS

    for _ in range(400):
        op = rng.random()
        if op < 0.35 and req_pool.available_size() > 0:
            tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 8))]
            need = len(tokens)
            if allocator.available_size() < need:
                cache.evict(need - allocator.available_size())
            if allocator.available_size() >= need:
                live.append(start_req(cache, pools, tokens))
        elif op < 0.6 and live:
            req = rng.choice(live)
            grow = rng.randint(1, 4)
            if len(req.kv_token_ids) + grow <= CONTEXT_LEN:
                if allocator.available_size() < grow:
                    cache.evict(grow)
                new = allocator.alloc(grow)
                if new is not None:
                    n = len(req.kv_token_ids)
                    req_pool.req_to_token[req.req_pool_idx, n : n + grow] = new
                    req.kv_token_ids = req.kv_token_ids + [rng.choice(alphabet) for _ in range(grow)]
                    if rng.random() < 0.5:
                        cache.cache_unfinished_req(req)
        elif op < 0.85 and live:
            req = live.pop(rng.randrange(len(live)))
            cache.cache_finished_req(req)
        else:
            cache.evict(rng.randint(1, 10))
        check()

    for req in live:
        cache.cache_finished_req(req)
    live.clear()
    check()
    assert cache.protected_size() == 0
    cache.evict(KV_SLOTS)
    assert allocator.available_size() == KV_SLOTS
    assert req_pool.available_size() == REQ_ROWS


def test_reset_forgets_everything(cache):
    insert_new(cache, [1, 2, 3])
    cache.reset()
    assert cache.total_size() == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0


# ---- residency observer -------------------------------------------------------------------------------


class RecordingObserver:
    def __init__(self):
        self.events: list[tuple[str, int, float]] = []

    def node_created(self, node_id: int, now: float) -> None:
        self.events.append(("created", node_id, now))

    def node_hit(self, node_id: int, now: float) -> None:
        self.events.append(("hit", node_id, now))

    def node_evicted(self, node_id: int, now: float) -> None:
        self.events.append(("evicted", node_id, now))


def test_observer_sees_creation_hits_splits_and_evictions(pools):
    observer = RecordingObserver()
    cache = RadixCache(*pools, residency_observer=observer)
    insert_new(cache, [1, 2, 3, 4])
    ((kind, leaf_id, created_at),) = observer.events
    assert kind == "created"

    observer.events.clear()
    head = cache.match_prefix([1, 2]).last_node
    created = [e for e in observer.events if e[0] == "created"]
    assert created == [("created", head.id, created_at)], "a split's new node keeps the original's age"
    assert ("hit", head.id) in [(k, i) for k, i, _ in observer.events]
    assert head.id != leaf_id

    observer.events.clear()
    cache.evict(KV_SLOTS)
    assert sorted(i for k, i, _ in observer.events if k == "evicted") == sorted([head.id, leaf_id])


# ---- ChunkCache -----------------------------------------------------------------------------------------


def test_chunk_cache_never_shares_and_frees_everything_when_done(pools):
    req_pool, allocator = pools
    cache = ChunkCache(req_pool, allocator)
    match = cache.match_prefix([1, 2, 3])
    assert match.device_indices.numel() == 0 and match.last_node is None

    row = req_pool.alloc(1)[0]
    slots = allocator.alloc(3)
    req_pool.req_to_token[row, :3] = slots
    req = FakeReq(row, [1, 2, 3])
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == slots.tolist()
    assert req.last_node is None
    assert allocator.available_size() == KV_SLOTS - 3

    more = allocator.alloc(2)
    req_pool.req_to_token[row, 3:5] = more
    req.kv_token_ids = [1, 2, 3, 4, 5]
    cache.cache_finished_req(req)
    assert allocator.available_size() == KV_SLOTS
    assert req_pool.available_size() == REQ_ROWS
    assert cache.total_size() == 0 and cache.evict(10) == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0


# ---- LoRA namespaces: an adapter's prefixes never serve the base model or another adapter ----------------


def test_a_prefix_cached_under_one_adapter_serves_only_that_adapter(cache):
    key = [1, 2, 3, 4, 5]
    slots = cache.token_to_kv_pool_allocator.alloc(len(key))
    assert cache.insert(key, slots, "a") == 0
    assert len(cache.match_prefix(key, "a").device_indices) == 5
    assert len(cache.match_prefix(key).device_indices) == 0  # the base model computes other KV
    assert len(cache.match_prefix(key, "b").device_indices) == 0
    base = insert_new(cache, key)  # the same tokens under the base model get slots of their own
    assert not set(base.tolist()) & set(slots.tolist())
    assert cache.evictable_size() == 10


def test_eviction_and_locks_span_every_namespace(cache):
    slots = cache.token_to_kv_pool_allocator.alloc(4)
    cache.insert([1, 2, 3, 4], slots, "a")
    insert_new(cache, [9, 8])
    match = cache.match_prefix([1, 2, 3, 4], "a")
    cache.inc_lock_ref(match.last_node)
    assert (cache.evictable_size(), cache.protected_size()) == (2, 4)
    assert cache.evict(100) == 2  # the adapter's locked path is kept, the base leaf goes
    cache.dec_lock_ref(match.last_node)
    assert cache.evict(100) == 4
    assert cache.total_size() == 0


def test_dropping_an_unloaded_adapters_namespace_frees_its_slots(cache):
    allocator = cache.token_to_kv_pool_allocator
    free = allocator.available_size()
    cache.insert([1, 2, 3], allocator.alloc(3), "a")
    slots = allocator.alloc(4)
    assert cache.insert([1, 2, 7, 8], slots, "a") == 2
    allocator.free(slots[:2])  # the duplicates of what the tree had, as a caller must
    insert_new(cache, [1, 2, 3])
    assert cache.drop_namespace("a") == 5  # [1, 2] [3] [7, 8]
    assert allocator.available_size() == free - 3
    assert len(cache.match_prefix([1, 2, 3], "a").device_indices) == 0
    assert len(cache.match_prefix([1, 2, 3]).device_indices) == 3 and cache.evictable_size() == 3
    assert cache.drop_namespace("never-loaded") == 0


def test_dropping_a_namespace_a_request_still_holds_is_refused(cache, pools):
    req_pool, allocator = pools
    cache.insert([1, 2, 3], allocator.alloc(3), "a")
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3], "a").last_node)
    with pytest.raises(RuntimeError, match="still has running requests"):
        cache.drop_namespace("a")
