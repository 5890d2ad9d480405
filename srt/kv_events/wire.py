"""The wire format of KV cache events, written with plain `msgpack` to match what vLLM's and SGLang's
msgspec structs produce, so their routers and subscribers decode srt's stream unchanged.

Message on the PUB socket: three frames [topic (utf-8), sequence number (8 bytes, big-endian), payload].
Payload: msgpack of an `EventBatch`, an array_like struct: [ts, events, data_parallel_rank].
  ts                  wall-clock seconds (float64) when the publisher thread formed the batch
  data_parallel_rank  the scheduler's DP rank (int; SGLang's `attn_dp_rank` sits in the same slot)
Events are msgspec tagged structs, the tag being the class name:
  array layout (default): ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                           medium, lora_name]
                          ["BlockRemoved", block_hashes, medium]
                          ["AllBlocksCleared"]
  map layout:             {"type": "BlockStored", "block_hashes": ..., ...} with the same fields
Hashes are signed int64; lora_id and lora_name name the LoRA adapter whose KV the blocks hold (null for the
base model); medium is "GPU", the name
both peers give the engine's primary KV pool, which srt reports even when that pool is in host memory.
A decoder whose struct lacks the trailing fields ignores them (msgspec ignores extra trailing array
elements), and one that expects them finds them, so every field up to `lora_name` is always written.

Replay (ROUTER socket): a client (REQ or DEALER with an empty delimiter) sends one frame, the first
sequence number it wants (8 bytes, big-endian); the publisher answers with [seq, payload] for every
buffered batch from there on, then the end marker [(-1 as 8 signed bytes), b""].
"""

from __future__ import annotations

import msgpack

from srt.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

MEDIUM = "GPU"
SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
TAG_KEY = "type"  # msgspec's default tag field in the map layout
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_REMOVED_FIELDS = ("block_hashes", "medium")


def event_fields(event: KVCacheEvent) -> tuple[str, tuple]:
    """The tag and the ordered field values of one event."""
    if isinstance(event, BlockStored):
        values = (
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            MEDIUM,
            event.lora_name,
        )
        return "BlockStored", values
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", (event.block_hashes, MEDIUM)
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared", ()
    raise TypeError(f"not a KV cache event: {type(event).__name__}")


def _fields_of(tag: str) -> tuple[str, ...]:
    return {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())


def encode_event(event: KVCacheEvent, layout: str = "array") -> list | dict:
    tag, values = event_fields(event)
    if layout == "map":
        return {TAG_KEY: tag, **dict(zip(_fields_of(tag), values, strict=True))}
    return [tag, *values]


def encode_batch(ts: float, events: list[KVCacheEvent], dp_rank: int, layout: str = "array") -> bytes:
    return msgpack.packb([float(ts), [encode_event(e, layout) for e in events], dp_rank], use_bin_type=True)


def decode_event(raw: list | dict) -> KVCacheEvent:
    """One event of either layout back into srt's dataclasses (for subscribers and tests)."""
    if isinstance(raw, dict):
        tag = raw[TAG_KEY]
        values = [raw.get(name) for name in _fields_of(tag)]
    else:
        tag, values = raw[0], raw[1:]
    if tag == "BlockStored":
        lora = (values[4], values[6]) if len(values) > 6 else (None, None)
        return BlockStored(list(values[0]), values[1], list(values[2]), values[3], *lora)
    if tag == "BlockRemoved":
        return BlockRemoved(list(values[0]))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event tag {tag!r}")


def decode_batch(payload: bytes) -> tuple[float, list[KVCacheEvent], int | None]:
    """(ts, events, data_parallel_rank) of one payload."""
    ts, events, *rest = msgpack.unpackb(payload, raw=False)
    return ts, [decode_event(e) for e in events], rest[0] if rest else None


def frames(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    return topic, seq.to_bytes(SEQ_BYTES, "big"), payload


def parse_seq(seq_bytes: bytes) -> int:
    return int.from_bytes(seq_bytes, "big", signed=True)
