"""The scheduler's KV memory: which prefix cache sits over the paged pool, and the scheduler's account of its
slots, which retraction, the flush and the reporter read.

A slot that only an unlocked cached prefix holds counts as free: the cache gives it up on demand. So the room
a step can still take is `headroom` (free plus evictable), and what requests hold is the rest
(`used_tokens`). A request leaving the running batch (finished, aborted, retracted) gives its KV back to the
cache (`release`): its prefix stays cached, unlocked. `flush` drops every cached prefix, which the scheduler
allows only while no request holds KV.
"""

from __future__ import annotations

from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.kv_events import KVEventSink
from srt.mem_cache.radix_cache import RadixCache
from srt.model_executor.model_runner import ModelRunner
from srt.scheduler.pooling import needs_every_token
from srt.scheduler.schedule_batch import Req
from srt.server_args import ServerArgs


class KVMemory:
    def __init__(
        self,
        server_args: ServerArgs,
        model_runner: ModelRunner,
        residency_observer=None,  # the reporter's view of what the radix cache holds
        kv_events: KVEventSink | None = None,  # --kv-events-config's publisher (srt/kv_events/)
    ):
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        # no sharing with --disable-radix-cache, nor where pooling reads every token's hidden state
        if server_args.disable_radix_cache or (
            server_args.is_embedding and needs_every_token(server_args.pooling_type)
        ):
            self.tree_cache = ChunkCache(self.req_to_token_pool, self.allocator)
        else:
            self.tree_cache = RadixCache(
                self.req_to_token_pool,
                self.allocator,
                residency_observer=residency_observer,
                kv_events=kv_events,
            )

    def headroom(self) -> int:
        """KV slots a step can still take: free ones and those the cache can evict."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def used_tokens(self) -> int:
        """KV slots held by requests; evictable cache slots count as free."""
        return self.allocator.size - self.headroom()

    def release(self, req: Req) -> None:
        """Return a request's KV to the cache (shared prefixes stay cached, unlocked) and its pool row; it keeps
        no prefix (a retracted request matches the cache afresh when it is admitted again)."""
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
            req.req_pool_idx = None
        req.reset_prefix()

    def flush(self) -> None:
        """Drop every cached prefix and free every slot and row (the caller checks no request holds KV)."""
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
