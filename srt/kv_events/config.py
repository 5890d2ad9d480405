"""`--kv-events-config`: the JSON object both peers accept, parsed and checked once at start-up.

Keys (vLLM's and SGLang's names; anything else is an error, so a typo does not silently do nothing):
  publisher        "zmq" publishes; "null" accepts the config and publishes nothing
  endpoint         PUB socket, e.g. "tcp://*:5557" (required for zmq); a host of `*` or an ipc:// or
                   inproc:// address binds, a concrete tcp host connects (to a subscriber's proxy)
  replay_endpoint  ROUTER socket answering replay requests, e.g. "tcp://*:5558" (optional; always binds)
  topic            first frame of every message (default "")
  buffer_steps     batches kept for replay (default 10000)
  hwm              PUB send high-water mark: messages ZMQ queues per subscriber before dropping
  max_queue_size   events the scheduler may queue for the publisher thread before dropping (counted)
  block_size       tokens per reported block (srt's own key; default 16, vLLM's default block size)
  enable_kv_cache_events  vLLM's switch; false turns publishing off
  event_layout     "array" (default: SGLang's and vLLM's array_like events) or "map" (events as maps
                   tagged by "type", the layout of vLLM versions that dropped array_like on events)

Data parallelism (vLLM's rule): the scheduler of DP rank r publishes on the endpoint's port + r (an ipc or
inproc address gets the suffix `_dp<r>`), and the same for the replay endpoint; every batch carries its
rank as `data_parallel_rank`. The ranks' addresses must not collide, which is checked here.

Only the standard library is imported: ServerArgs.check() calls this in the HTTP process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PUBLISHERS = ("zmq", "null")
EVENT_LAYOUTS = ("array", "map")
SCHEMES = ("tcp://", "ipc://", "inproc://")
DEFAULT_BLOCK_SIZE = 16
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_MAX_QUEUE_SIZE = 100_000
FLAG = "--kv-events-config"


@dataclass(frozen=True)
class KVEventsConfig:
    publisher: str = "zmq"
    endpoint: str = ""
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    hwm: int = DEFAULT_HWM
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_kv_cache_events: bool = True
    event_layout: str = "array"

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq" and self.enable_kv_cache_events

    def endpoint_for(self, dp_rank: int) -> str:
        return offset_endpoint(self.endpoint, dp_rank)

    def replay_endpoint_for(self, dp_rank: int) -> str | None:
        return None if self.replay_endpoint is None else offset_endpoint(self.replay_endpoint, dp_rank)


_INT_KEYS = {"buffer_steps": 1, "hwm": 0, "max_queue_size": 1, "block_size": 1}  # key -> minimum


def parse_kv_events_config(text: str, dp_size: int = 1) -> KVEventsConfig:
    """The config, or ValueError with one line naming the flag and what to change."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG} is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(raw, dict):
        raise ValueError(f'{FLAG} must be a JSON object such as {{"publisher": "zmq", ...}}')
    known = KVEventsConfig.__dataclass_fields__
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"{FLAG}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    publisher = raw.get("publisher", "zmq")
    if publisher not in PUBLISHERS:
        raise ValueError(f"{FLAG}: unknown publisher {publisher!r}; choose one of {', '.join(PUBLISHERS)}")
    for key in ("endpoint", "topic", "event_layout"):
        if key in raw and not isinstance(raw[key], str):
            raise ValueError(f"{FLAG}: {key} must be a string")
    if raw.get("replay_endpoint") is not None and not isinstance(raw["replay_endpoint"], str):
        raise ValueError(f"{FLAG}: replay_endpoint must be a string or null")
    if not isinstance(raw.get("enable_kv_cache_events", True), bool):
        raise ValueError(f"{FLAG}: enable_kv_cache_events must be true or false")
    for key, minimum in _INT_KEYS.items():
        value = raw.get(key, minimum)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{FLAG}: {key} must be an integer >= {minimum}")
    if raw.get("event_layout", "array") not in EVENT_LAYOUTS:
        raise ValueError(f"{FLAG}: event_layout must be one of {', '.join(EVENT_LAYOUTS)}")
    config = KVEventsConfig(**raw)
    if config.enabled:
        _check_endpoints(config, dp_size)
    return config


def _check_endpoints(config: KVEventsConfig, dp_size: int) -> None:
    if not config.endpoint:
        raise ValueError(f'{FLAG}: the zmq publisher needs an "endpoint", e.g. "tcp://*:5557"')
    named = [("endpoint", config.endpoint)]
    if config.replay_endpoint is not None:
        named.append(("replay_endpoint", config.replay_endpoint))
    for key, address in named:
        if not address.startswith(SCHEMES):
            raise ValueError(f"{FLAG}: {key} {address!r} must start with one of {', '.join(SCHEMES)}")
        if address.startswith("tcp://"):
            port = address.rpartition(":")[2]
            if not port.isdigit() or not 0 < int(port) + dp_size - 1 < 65536:
                raise ValueError(f"{FLAG}: {key} {address!r} needs a port in 1..65535 (one per DP rank)")
    seen: dict[str, str] = {}
    for rank in range(dp_size):
        for key, address in named:
            actual = offset_endpoint(address, rank)
            if actual in seen:
                raise ValueError(
                    f"{FLAG}: {key} of DP rank {rank} ({actual}) collides with {seen[actual]}; each DP rank "
                    "publishes on the configured port + its rank, so leave dp-size ports between the two"
                )
            seen[actual] = f"{key} of DP rank {rank}"


def offset_endpoint(address: str, dp_rank: int) -> str:
    """The address DP rank `dp_rank` uses: tcp port + rank, ipc/inproc name + `_dp<rank>`."""
    if dp_rank == 0:
        return address
    if address.startswith("tcp://"):
        host, _, port = address.rpartition(":")
        return f"{host}:{int(port) + dp_rank}"
    return f"{address}_dp{dp_rank}"


def binds(address: str) -> bool:
    """vLLM's convention: wildcard hosts and local transports bind, a concrete tcp host is connected to."""
    return not address.startswith("tcp://") or "*" in address or "::" in address
