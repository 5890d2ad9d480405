"""KV cache events: the wire format vLLM's and SGLang's subscribers decode, the
`--kv-events-config` checks, the radix cache's hooks, the non-blocking publisher with its replay socket,
and a subscriber that rebuilds exactly the blocks the scheduler's radix cache holds."""

from __future__ import annotations

import hashlib
import random

import msgpack
import pytest
import zmq

from srt.kv_events.config import KVEventsConfig, offset_endpoint, parse_kv_events_config
from srt.kv_events.publisher import ZmqEventPublisher
from srt.kv_events.wire import END_SEQ, decode_batch, encode_batch, frames
from srt.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, block_id, chain_digests
from srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from srt.mem_cache.radix_cache import RadixCache
from srt.model_executor.model_runner import ModelRunner
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs
from test.unit.kv_event_subscriber import BlockSetSubscriber, tree_blocks, wait_sent
from test.unit.scheduler_driver import drive, greedy, request

B = 4  # block size of the cache tests: small, so short keys span several blocks


# ---------------------------------------------------------------- wire format
def test_batch_is_an_array_like_event_batch():
    stored = BlockStored([11, -12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    payload = encode_batch(1.5, [stored, BlockRemoved([11]), AllBlocksCleared()], dp_rank=3)
    assert msgpack.unpackb(payload) == [
        1.5,
        [
            # tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
            ["BlockStored", [11, -12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None],
            ["BlockRemoved", [11], "GPU"],
            ["AllBlocksCleared"],
        ],
        3,
    ]
    assert decode_batch(payload) == (1.5, [stored, BlockRemoved([11]), AllBlocksCleared()], 3)


def test_map_layout_tags_events_by_type():
    payload = encode_batch(2.0, [BlockStored([5], 4, [1, 2], 2), AllBlocksCleared()], 0, layout="map")
    ts, events, rank = msgpack.unpackb(payload)
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [5],
        "parent_block_hash": 4,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert events[1] == {"type": "AllBlocksCleared"}
    assert decode_batch(payload)[1] == [BlockStored([5], 4, [1, 2], 2), AllBlocksCleared()]


def test_frames_are_topic_big_endian_sequence_and_payload():
    topic, seq, payload = frames(b"kv", 258, b"x")
    assert (topic, seq, payload) == (b"kv", b"\x00\x00\x00\x00\x00\x00\x01\x02", b"x")
    assert END_SEQ == b"\xff" * 8


def test_block_hash_is_sglangs_chained_sha256():
    tokens = [7, 8, 9, 70000, 1, 2, 3, 4]
    d0, d1 = chain_digests(None, tokens, 4)
    expected0 = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens[:4])).digest()
    expected1 = hashlib.sha256(expected0 + b"".join(t.to_bytes(4, "little") for t in tokens[4:])).digest()
    assert (d0, d1) == (expected0, expected1)
    # SGLang's hash_str_to_int64: the first 16 hex digits as a signed 64-bit integer
    as_uint = int(expected1.hex()[:16], 16)
    assert block_id(d1) == (as_uint - (1 << 64) if as_uint >= 1 << 63 else as_uint)


# ---------------------------------------------------------------- --kv-events-config
def test_config_parses_the_peers_keys():
    cfg = parse_kv_events_config(
        '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv",'
        ' "buffer_steps": 5, "hwm": 10, "max_queue_size": 7, "block_size": 32}'
    )
    assert cfg.enabled and cfg.topic == "kv" and cfg.block_size == 32 and cfg.max_queue_size == 7
    assert not parse_kv_events_config('{"publisher": "null"}').enabled
    assert not parse_kv_events_config('{"endpoint": "tcp://*:1", "enable_kv_cache_events": false}').enabled


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "is not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"publisher": "kafka", "endpoint": "tcp://*:5557"}', "unknown publisher 'kafka'"),
        ('{"publisher": "zmq"}', 'needs an "endpoint"'),
        ('{"endpoint": "tcp://*:5557", "topik": "kv"}', "unknown key(s) topik"),
        ('{"endpoint": "http://x:5557"}', "must start with one of"),
        ('{"endpoint": "tcp://*:port"}', "needs a port"),
        ('{"endpoint": "tcp://*:5557", "block_size": 0}', "block_size must be an integer >= 1"),
        ('{"endpoint": "tcp://*:5557", "event_layout": "xml"}', "event_layout must be one of"),
    ],
)
def test_bad_config_is_one_clear_line(text, message):
    with pytest.raises(ValueError, match=r"--kv-events-config") as e:
        ServerArgs(kv_events_config=text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_config_exits_2_from_the_command_line(capsys):
    with pytest.raises(SystemExit) as e:
        ServerArgs.parse(["--kv-events-config", '{"publisher": "kafka"}'])
    assert e.value.code == 2
    assert "--kv-events-config: unknown publisher 'kafka'" in capsys.readouterr().err


def test_dp_ranks_offset_the_port_and_must_not_collide():
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    both = '{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
    parse_kv_events_config(both, dp_size=1)
    with pytest.raises(ValueError, match="collides"):
        ServerArgs(kv_events_config=both, dp_size=2)
    parse_kv_events_config('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567"}', dp_size=2)


# ---------------------------------------------------------------- radix-cache hooks
class Recorder:
    block_size = B

    def __init__(self):
        self.events = []

    def publish(self, event):
        self.events.append(event)

    def take(self):
        events, self.events = self.events, []
        return events


def make_cache(slots: int = 256):
    sink = Recorder()
    allocator = TokenToKVPoolAllocator(slots)
    cache = RadixCache(ReqToTokenPool(4, 64), allocator, kv_events=sink)
    return cache, sink, allocator


def insert(cache, allocator, key):
    slots = allocator.alloc(len(key))
    present = cache.insert(key, slots)
    if present:
        allocator.free(slots[:present])


def ids(tokens, parent=None):
    return [block_id(d) for d in chain_digests(parent, tokens, B)]


def test_construction_and_reset_clear_all_blocks():
    cache, sink, _ = make_cache()
    assert sink.take() == [AllBlocksCleared()]
    cache.reset()
    assert sink.take() == [AllBlocksCleared()]


def test_insert_publishes_full_blocks_only_and_chains_across_nodes():
    cache, sink, allocator = make_cache()
    sink.take()
    insert(cache, allocator, list(range(10)))  # blocks [0..3], [4..7]; tokens 8, 9 are a partial block
    assert sink.take() == [BlockStored(ids(list(range(8))), None, list(range(8)), B)]
    # Diverges at position 6: the new leaf holds tokens 6..12, so it owns block [4..7] of its own path
    # (which begins in the parent) and block [8..11]; its parent block is [0..3].
    key = [0, 1, 2, 3, 4, 5, 60, 61, 62, 63, 64, 65, 66]
    insert(cache, allocator, key)
    digests = chain_digests(None, key[:12], B)
    assert sink.take() == [
        BlockStored([block_id(d) for d in digests[1:]], block_id(digests[0]), key[4:12], B)
    ]
    # A key that ends inside an existing node only splits it: the cached set is unchanged, no event.
    cache.match_prefix([0, 1, 2])
    insert(cache, allocator, [0, 1, 2, 3, 4])
    assert sink.take() == []
    assert tree_blocks(cache, B) == set(ids(list(range(8)))) | {block_id(d) for d in digests}


def test_split_divides_the_block_digests_between_the_halves():
    cache, sink, allocator = make_cache()
    insert(cache, allocator, list(range(12)))
    (node,) = cache.root.children.values()
    assert len(node.block_digests) == 3
    cache.match_prefix(list(range(6)))  # split after 6 tokens: block [0..3] ends in the head
    (head,) = cache.root.children.values()
    (tail,) = head.children.values()
    assert (head.start, len(head.block_digests)) == (0, 1)
    assert (tail.start, len(tail.block_digests)) == (6, 2)


def test_evict_removes_the_leaves_blocks_in_one_event():
    cache, sink, allocator = make_cache()
    insert(cache, allocator, list(range(8)))
    insert(cache, allocator, [0, 1, 2, 3, 9, 9, 9, 9, 9])
    sink.take()
    cache.evict(10_000)
    (removed,) = sink.take()
    assert isinstance(removed, BlockRemoved)
    assert sorted(removed.block_hashes) == sorted(ids(list(range(8))) + ids([0, 1, 2, 3, 9, 9, 9, 9])[1:])
    assert cache.total_size() == 0


def test_events_off_keeps_nodes_free_of_digests():
    allocator = TokenToKVPoolAllocator(64)
    cache = RadixCache(ReqToTokenPool(4, 64), allocator)
    insert(cache, allocator, list(range(20)))
    assert all(not n.block_digests for n in cache.root.children.values())


def test_random_workload_events_rebuild_the_tree():
    """Inserts over a small alphabet (so prefixes are shared and nodes split), prefix matches (more splits),
    evictions and resets: after every operation, the blocks stored and not removed are the tree's."""
    rng = random.Random(0)
    cache, sink, allocator = make_cache(slots=400)
    seen: set[int] = set()
    for step in range(400):
        op = rng.random()
        if op < 0.55:
            key = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
            if allocator.available_size() < len(key):
                cache.evict(len(key))
            insert(cache, allocator, key)
        elif op < 0.8:
            cache.match_prefix([rng.randrange(3) for _ in range(rng.randint(1, 30))])
        elif op < 0.98:
            cache.evict(rng.randint(1, 40))
        else:
            cache.reset()
            allocator.clear()
        for event in sink.take():
            if isinstance(event, BlockStored):
                assert not seen & set(event.block_hashes), "a block stored twice"
                seen.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= seen, "a block removed that was never stored"
                seen.difference_update(event.block_hashes)
            else:
                seen.clear()
        assert seen == tree_blocks(cache, B), f"diverged at step {step}"


# ---------------------------------------------------------------- publisher
def ipc_config(tmp_path, **overrides) -> KVEventsConfig:
    return KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/kv",
        replay_endpoint=f"ipc://{tmp_path}/kv-replay",
        topic="kv",
        **overrides,
    )


class FakeCounter:
    def __init__(self):
        self.value = 0

    def inc(self, n):
        self.value += n


def test_full_queue_drops_and_counts_without_blocking(tmp_path):
    published, dropped = FakeCounter(), FakeCounter()
    pub = ZmqEventPublisher(
        ipc_config(tmp_path, max_queue_size=3), counters=(published, dropped), start_thread=False
    )
    try:
        for _ in range(5):
            pub.publish(AllBlocksCleared())
        assert pub.dropped == 2
        pub._send_queued()
        pub._update_counters()
        assert (published.value, dropped.value) == (3, 2)
    finally:
        pub.close()


def test_subscriber_gets_batches_and_replays_what_it_missed(tmp_path):
    cfg = ipc_config(tmp_path, buffer_steps=100)
    pub = ZmqEventPublisher(cfg, dp_rank=1)
    sub = BlockSetSubscriber(cfg.endpoint_for(1), "kv", cfg.replay_endpoint_for(1))
    try:
        assert pub.endpoint.endswith("_dp1")
        for i in range(3):  # likely sent before the subscription arrives: recovered by replay
            pub.publish(BlockStored([i], None, [i], 1))
            wait_sent(pub)
        pub.publish(BlockRemoved([0]))
        sub.catch_up(wait_sent(pub))
        assert sub.blocks == {1, 2} and sub.dp_ranks == {1}
        assert [seq for seq, _ in sub.replay(2)] == [2, 3]
        assert sub.replay(99) == []  # only the end marker
    finally:
        sub.close()
        pub.close()


def test_bind_failure_is_a_config_error():
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    try:
        with pytest.raises(ValueError, match=f"--kv-events-config: cannot bind tcp://\\*:{port}"):
            ZmqEventPublisher(KVEventsConfig(endpoint=f"tcp://*:{port}"))
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------- the scheduler, end to end in-process
def test_subscriber_rebuilds_the_schedulers_radix_cache(tiny_model_dir, tmp_path):
    cfg = ipc_config(tmp_path, block_size=B)
    pub = ZmqEventPublisher(cfg)
    sub = BlockSetSubscriber(cfg.endpoint, "kv", cfg.replay_endpoint)
    args = ServerArgs(max_total_tokens=160, max_running_requests=4)
    runner = ModelRunner(tiny_model_dir, max_total_tokens=160, max_running_requests=4)
    sched = Scheduler(args, runner, kv_events=pub)
    rng = random.Random(1)
    shared = [rng.randrange(10, 200) for _ in range(18)]
    try:
        # shared prefixes (splits), more tokens than the pool holds (evictions), then a flush
        for wave in range(4):
            reqs = []
            for i in range(4):
                suffix = [rng.randrange(10, 200) for _ in range(rng.randint(3, 14))]
                reqs.append(request(f"w{wave}r{i}", shared[: rng.randint(5, 18)] + suffix, greedy(6)))
            drive(sched, {0: reqs})
            sub.catch_up(wait_sent(pub))
            assert sub.blocks == tree_blocks(sched.tree_cache, B), f"wave {wave}"
        assert sub.removed > 0 and sub.removed_unknown == []  # evictions happened and were consistent
        assert sched.flush_cache()
        sub.catch_up(wait_sent(pub))
        assert sub.blocks == set() == tree_blocks(sched.tree_cache, B)
    finally:
        sub.close()
        pub.close()


def test_an_adapters_blocks_carry_its_id_and_chain_from_its_seed():
    """The same tokens under a LoRA adapter are other KV: other block ids, and the adapter named in the
    event (vLLM's lora_id and lora_name), through the wire format and back."""
    from srt.kv_events.wire import decode_event, encode_event
    from srt.mem_cache.kv_events import adapter_id, adapter_seed

    cache, sink, allocator = make_cache()
    sink.take()
    tokens = list(range(8))
    insert(cache, allocator, tokens)
    slots = allocator.alloc(8)
    cache.insert(tokens, slots, "sql-lora")
    base, adapted = sink.take()
    assert adapted == BlockStored(
        ids(tokens, adapter_seed("sql-lora")), None, tokens, B, adapter_id("sql-lora"), "sql-lora"
    )
    assert not set(base.block_hashes) & set(adapted.block_hashes)
    assert base.lora_id is None and base.lora_name is None
    for layout in ("array", "map"):
        assert decode_event(encode_event(adapted, layout)) == adapted
    assert cache.drop_namespace("sql-lora") == 8
    assert sink.take() == [BlockRemoved(adapted.block_hashes)]
