"""Specification of the KV memory pools: slot allocation, exhaustion, reuse and the K/V buffers."""

import random

import pytest
import torch

from srt.mem_cache.memory_pool import PADDING_SLOT, MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator

POOL_SIZE = 16


@pytest.fixture
def allocator() -> TokenToKVPoolAllocator:
    return TokenToKVPoolAllocator(POOL_SIZE)


def test_alloc_returns_distinct_int64_slots_from_1_to_size(allocator):
    slots = allocator.alloc(POOL_SIZE)
    assert slots.dtype == torch.int64
    assert sorted(slots.tolist()) == list(range(1, POOL_SIZE + 1))
    assert PADDING_SLOT not in slots.tolist()
    assert allocator.available_size() == 0


def test_alloc_beyond_available_returns_none_and_takes_nothing(allocator):
    allocator.alloc(POOL_SIZE - 3)
    assert allocator.alloc(4) is None
    assert allocator.available_size() == 3
    assert allocator.alloc(3) is not None
    assert allocator.alloc(1) is None


def test_alloc_zero_is_an_empty_tensor(allocator):
    assert allocator.alloc(0).numel() == 0
    assert allocator.available_size() == POOL_SIZE


def test_freed_slots_are_reused(allocator):
    first = allocator.alloc(POOL_SIZE)
    allocator.free(first[:5])
    assert allocator.available_size() == 5
    again = allocator.alloc(5)
    assert sorted(again.tolist()) == sorted(first[:5].tolist())


def test_free_of_empty_tensor_changes_nothing(allocator):
    allocator.free(torch.empty(0, dtype=torch.int64))
    assert allocator.available_size() == POOL_SIZE


def test_random_alloc_free_never_hands_out_a_live_slot_twice(allocator):
    rng = random.Random(0)
    live: list[int] = []
    for _ in range(500):
        if live and rng.random() < 0.5:
            rng.shuffle(live)
            n = rng.randint(1, len(live))
            allocator.free(torch.tensor(live[:n]))
            live = live[n:]
        else:
            n = rng.randint(1, 6)
            got = allocator.alloc(n)
            if got is None:
                assert allocator.available_size() < n
                continue
            assert len(got) == n
            assert not set(got.tolist()) & set(live), "a live slot was handed out again"
            assert PADDING_SLOT not in got.tolist()
            live.extend(got.tolist())
        assert allocator.available_size() + len(live) == POOL_SIZE


def test_clear_restores_every_slot(allocator):
    allocator.alloc(10)
    allocator.clear()
    assert allocator.available_size() == POOL_SIZE
    assert sorted(allocator.alloc(POOL_SIZE).tolist()) == list(range(1, POOL_SIZE + 1))


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    assert pool.req_to_token.shape == (3, 8)
    assert pool.req_to_token.dtype == torch.int64
    rows = pool.alloc(2)
    assert len(set(rows)) == 2 and all(0 <= r < 3 for r in rows)
    assert pool.alloc(2) is None
    assert pool.available_size() == 1
    pool.free(rows[0])
    pool.free([rows[1]])
    assert pool.available_size() == 3
    pool.alloc(3)
    pool.clear()
    assert pool.available_size() == 3
    assert sorted(pool.alloc(3)) == [0, 1, 2]


def test_kv_pool_writes_only_the_given_slots():
    pool = MHATokenToKVPool(size=8, dtype=torch.float32, head_num=2, head_dim=4, layer_num=3)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert k_buf.shape == (9, 2, 4) and v_buf.shape == (9, 2, 4)
    loc = torch.tensor([2, 5])
    k = torch.randn(2, 2, 4)
    v = torch.randn(2, 2, 4)
    pool.set_kv_buffer(1, loc, k, v)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    untouched = [i for i in range(9) if i not in (2, 5)]
    assert k_buf[untouched].abs().sum() == 0
    assert pool.get_kv_buffer(0)[0].abs().sum() == 0, "other layers are untouched"


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert MHATokenToKVPool.bytes_per_token(torch.float32, 3, 64, 30) == 2 * 3 * 64 * 30 * 4
    assert MHATokenToKVPool.bytes_per_token(torch.bfloat16, 1, 8, 2) == 2 * 1 * 8 * 2 * 2


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_kv_pool_is_zero_and_resident_only_where_written():
    before = resident_mib()
    pool = MHATokenToKVPool(100_000, torch.float32, 4, 64, 2)  # 2 layers x K and V x ~98 MiB
    assert resident_mib() - before < 40  # sized for the worst case, resident for what is used
    k, v = pool.get_kv_buffer(1)
    assert k.shape == (100_001, 4, 64) and k.dtype == torch.float32
    assert not k.any() and not v.any()
    k[:50_000] = 1.0  # half of one buffer: ~49 MiB
    grown = resident_mib() - before
    assert 40 < grown < 100
    assert k[:50_000].eq(1.0).all() and not k[50_000:].any()
