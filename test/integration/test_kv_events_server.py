"""KV cache events from a real server: a subscriber that joins after start-up replays
what it missed, sees the blocks of the prompts it sent, and sees them all go on /flush_cache."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from srt.mem_cache.kv_events import block_id, chain_digests
from srt.sockets import find_free_port
from test.integration.conftest import running_server
from test.unit.kv_event_subscriber import BlockSetSubscriber

pytestmark = pytest.mark.slow

BLOCK = 4
TOPIC = "kv"
WAIT_SECONDS = 20.0


def until(sub: BlockSetSubscriber, predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}; have {len(sub.blocks)} blocks"
        sub.poll(100)


def prompt_blocks(input_ids: list[int]) -> set[int]:
    full = len(input_ids) // BLOCK * BLOCK
    return {block_id(d) for d in chain_digests(None, input_ids[:full], BLOCK)}


def test_subscriber_follows_requests_and_flush():
    pub_port, replay_port = find_free_port(), find_free_port()
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": TOPIC,
        "block_size": BLOCK,
    }
    with running_server("--kv-events-config", json.dumps(config)) as server:
        sub = BlockSetSubscriber(f"tcp://127.0.0.1:{pub_port}", TOPIC, f"tcp://127.0.0.1:{replay_port}")
        try:
            # Start-up published AllBlocksCleared as batch 0, before anyone subscribed.
            [(seq, _)] = sub.replay(0)[:1]
            assert seq == 0
            time.sleep(0.3)  # let the subscription reach the publisher
            shared = list(range(1000, 1013))
            prompts = [shared + [2000, 2001, 2002], shared + [3000, 3001, 3002, 3003, 3004]]
            for ids in prompts:
                r = httpx.post(
                    f"{server.base_url}/generate",
                    json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
                    timeout=60,
                )
                assert r.status_code == 200, r.text
            wanted = set().union(*(prompt_blocks(p) for p in prompts))
            until(sub, lambda: wanted <= sub.blocks, "the prompts' blocks")
            assert sub.last_seq >= 1 and sub.replayed >= 1  # batch 0 came through the replay socket
            assert sub.dp_ranks == {0} and sub.removed_unknown == []

            r = httpx.post(f"{server.base_url}/flush_cache", timeout=30)
            assert r.status_code == 200, r.text
            until(sub, lambda: not sub.blocks, "AllBlocksCleared after /flush_cache")

            metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
            published = re.search(r"^sglang:kv_events_published_total\{.*\} (\S+)$", metrics, re.M)
            dropped = re.search(r"^sglang:kv_events_dropped_total\{.*\} (\S+)$", metrics, re.M)
            assert published and float(published.group(1)) >= 3  # cleared, stored x2 (and more)
            assert dropped and float(dropped.group(1)) == 0
        finally:
            sub.close()
