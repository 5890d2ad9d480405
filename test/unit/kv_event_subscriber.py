"""A KV-aware router's view of one engine, for tests: subscribes to the event stream, asks for a replay
when it sees a gap in the sequence numbers, and keeps the set of block hashes the engine holds."""

from __future__ import annotations

import time

import zmq

from srt.kv_events.wire import decode_batch, parse_seq
from srt.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, block_id, chain_digests

REPLAY_TIMEOUT_MS = 2000
IDLE_BEFORE_REPLAY_MS = 200


class BlockSetSubscriber:
    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.blocks: set[int] = set()
        self.last_seq = -1
        self.replayed = 0  # batches recovered through the replay socket
        self.dp_ranks: set[int | None] = set()
        self.removed = 0  # blocks removed
        self.removed_unknown: list[int] = []  # BlockRemoved of a hash never stored: a protocol violation

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def apply(self, payload: bytes) -> None:
        _, events, dp_rank = decode_batch(payload)
        self.dp_ranks.add(dp_rank)
        for event in events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                self.blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.removed_unknown += [h for h in event.block_hashes if h not in self.blocks]
                self.blocks.difference_update(event.block_hashes)
                self.removed += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every buffered batch from `start` on, through a DEALER socket (REQ-compatible envelope)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        try:
            while True:
                assert dealer.poll(REPLAY_TIMEOUT_MS), "no replay answer"
                _, seq_bytes, payload = dealer.recv_multipart()
                if not payload:  # end marker
                    assert parse_seq(seq_bytes) == -1
                    return got
                got.append((parse_seq(seq_bytes), payload))
        finally:
            dealer.close()

    def poll(self, timeout_ms: int = 50) -> bool:
        """Receive one message if any; fill a gap before it from the replay socket."""
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == self.topic
        seq = parse_seq(seq_bytes)
        if seq > self.last_seq + 1:
            for missed_seq, missed in self.replay(self.last_seq + 1):
                if self.last_seq < missed_seq < seq:
                    self.apply(missed)
                    self.last_seq = missed_seq
                    self.replayed += 1
        assert seq == self.last_seq + 1, f"sequence gap not filled: {self.last_seq} -> {seq}"
        self.apply(payload)
        self.last_seq = seq
        return True

    def catch_up(self, last_seq: int, timeout: float = 10.0) -> None:
        """Read until batch `last_seq` has been applied."""
        deadline = time.monotonic() + timeout
        while self.last_seq < last_seq:
            assert time.monotonic() < deadline, f"stuck at seq {self.last_seq}, expected {last_seq}"
            if not self.poll(IDLE_BEFORE_REPLAY_MS) and self.replay_endpoint is not None:
                # the last batches went out before the subscription reached the publisher
                for seq, payload in self.replay(self.last_seq + 1):
                    if seq == self.last_seq + 1:
                        self.apply(payload)
                        self.last_seq = seq
                        self.replayed += 1


def wait_sent(pub, timeout: float = 10.0) -> int:
    """The sequence number of the last batch, once the publisher thread has sent every accepted event."""
    deadline = time.monotonic() + timeout
    while pub.published < pub.accepted:
        assert time.monotonic() < deadline, "publisher thread did not send its queue"
        time.sleep(0.005)
    return pub._seq - 1


def tree_blocks(cache, block_size: int) -> set[int]:
    """The hashes of every full block on the radix tree's paths, computed from the tree itself."""
    blocks: set[int] = set()
    stack = [(cache.root, [])]
    while stack:
        node, path = stack.pop()
        path = path + list(node.key)
        if not node.children:
            full = len(path) // block_size * block_size
            blocks.update(block_id(d) for d in chain_digests(None, path[:full], block_size))
        stack.extend((child, path) for child in node.children.values())
    return blocks
