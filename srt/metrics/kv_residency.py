"""KV residency histograms for `--kv-cache-metrics`: how long radix-cache nodes live, how long they sit
idle before eviction, and how long between reuses.

Only a fraction of nodes is tracked, picked by a hash of the node id, so the choice is deterministic (the
same node is either always or never tracked) and the per-event cost for untracked nodes is one multiply
and a compare. The RadixCache calls the observer; it knows nothing about prometheus.
"""

from __future__ import annotations

from prometheus_client import Histogram

from srt.metrics.buckets import KV_RESIDENCY_BUCKETS

# Knuth's multiplicative hash: spreads consecutive node ids evenly over 32 bits.
_HASH_MULTIPLIER = 2654435761
_HASH_SPACE = 1 << 32


def is_sampled(node_id: int, threshold: int) -> bool:
    return (node_id * _HASH_MULTIPLIER) % _HASH_SPACE < threshold


class KVResidencyObserver:
    """The `residency_observer` of RadixCache. `now` is `time.monotonic()` of the scheduler process."""

    def __init__(self, labels: dict[str, str], sample_fraction: float) -> None:
        names = list(labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=KV_RESIDENCY_BUCKETS).labels(**labels)

        self._lifetime = histogram(
            "sglang:kv_block_lifetime_seconds", "Radix-cache node lifetime, insertion to eviction (sampled)."
        )
        self._idle = histogram(
            "sglang:kv_block_idle_before_evict_seconds", "Time since the last access when a node is evicted."
        )
        self._reuse_gap = histogram(
            "sglang:kv_block_reuse_gap_seconds", "Time between successive accesses of a node (sampled)."
        )
        self._threshold = int(sample_fraction * _HASH_SPACE)
        self._tracked: dict[int, tuple[float, float]] = {}  # node id -> (created, last access)

    def node_created(self, node_id: int, now: float) -> None:
        if is_sampled(node_id, self._threshold):
            self._tracked[node_id] = (now, now)

    def node_hit(self, node_id: int, now: float) -> None:
        entry = self._tracked.get(node_id)
        if entry is None:
            return
        created, last = entry
        self._reuse_gap.observe(now - last)
        self._tracked[node_id] = (created, now)

    def node_evicted(self, node_id: int, now: float) -> None:
        entry = self._tracked.pop(node_id, None)
        if entry is None:
            return
        created, last = entry
        self._lifetime.observe(now - created)
        self._idle.observe(now - last)

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)
