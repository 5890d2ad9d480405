"""What the radix cache tells a KV-aware router: which fixed-size token blocks it holds.

srt's KV pool is token-granular (page size 1), but routers reason in blocks: a router hashes a prompt's
blocks and asks which engine already holds the longest run of them. So the cache reports *blocks* of
`block_size` tokens aligned to the start of the sequence: block k of a sequence is its tokens
[k*B, (k+1)*B). A block is cached exactly when the radix tree holds a path covering all its tokens; it
belongs to the tree node that holds its last token. Partial blocks at the end of a path are not reported.

Block hash (SGLang's scheme, so a router that reproduces SGLang's page hashes gets the same ids):
    digest_k = sha256(digest_{k-1} + the block's token ids as unsigned 32-bit little-endian)
with no prefix for block 0; the event id is the digest's first 8 bytes read as a big-endian signed int64.
The chain makes the id of a block depend on every token before it, so equal ids mean equal prefixes.

This module is pure (no sockets, no threads): the cache builds events and hands them to a `KVEventSink`,
whose `publish` must return at once (see `srt/kv_events/publisher.py`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Protocol

DIGEST_ID_BYTES = 8  # the event id is the digest's first 64 bits
TOKEN_BYTES = 4  # each token id is hashed as an unsigned 32-bit little-endian integer


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became cached, in sequence order; `token_ids` holds len(block_hashes) * block_size
    tokens. `parent_block_hash` is the id of the block just before the first one (None at the start)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    # the LoRA adapter whose KV these blocks hold (None: the base model): `lora_id` is `adapter_id(name)`
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventSink(Protocol):
    """Receives the cache's events in order. `publish` must never block and never raise."""

    block_size: int

    def publish(self, event: KVCacheEvent) -> None: ...


def chain_digests(parent: bytes | None, tokens: list[int], block_size: int) -> list[bytes]:
    """Digests of the consecutive full blocks of `tokens` (len a multiple of block_size), chained after
    `parent` (the digest of the block before them, None at the start of a sequence)."""
    data = struct.pack(f"<{len(tokens)}I", *tokens)
    step = TOKEN_BYTES * block_size
    digests = []
    for offset in range(0, len(data), step):
        h = hashlib.sha256() if parent is None else hashlib.sha256(parent)
        h.update(data[offset : offset + step])
        parent = h.digest()
        digests.append(parent)
    return digests


def block_id(digest: bytes) -> int:
    return int.from_bytes(digest[:DIGEST_ID_BYTES], "big", signed=True)


def adapter_seed(name: str) -> bytes:
    """The digest a LoRA adapter's chains start from (the base model's start from none): blocks of equal
    tokens under two adapters hold different KV, so their ids must differ."""
    return hashlib.sha256(b"lora\0" + name.encode()).digest()


def adapter_id(name: str) -> int:
    """A LoRA adapter's `lora_id` in KV events: stable across processes and restarts, derived from its name."""
    return block_id(adapter_seed(name))
