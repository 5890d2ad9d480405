"""The scheduler's log lines (docs/metrics.md, "Log lines"), in the exact shapes operators grep for.

No prometheus here: the lines are written with `--disable-metrics` too.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

# Requests over which the summary's prefix-cache hit rate is computed (vLLM's window).
HIT_RATE_WINDOW_REQUESTS = 1000
_PERCENT = 100.0


def format_prefill_line(
    *, new_seq: int, new_token: int, cached_token: int, token_usage: float, running_req: int, queue_req: int
) -> str:
    """Keyword names mirror the line's own labels (`#new-seq` -> new_seq) so call sites read like the log."""
    return (
        f"Prefill batch. #new-seq: {new_seq}, #new-token: {new_token}, "
        f"#cached-token: {cached_token}, token usage: {token_usage:.2f}, "
        f"#running-req: {running_req}, #queue-req: {queue_req}"
    )


def format_decode_line(
    *, running_req: int, token: int, token_usage: float, gen_throughput: float, queue_req: int
) -> str:
    return (
        f"Decode batch. #running-req: {running_req}, #token: {token}, "
        f"token usage: {token_usage:.2f}, gen throughput (token/s): {gen_throughput:.2f}, "
        f"#queue-req: {queue_req}"
    )


def format_summary_line(
    prompt_throughput: float,
    generation_throughput: float,
    num_running_reqs: int,
    num_waiting_reqs: int,
    kv_cache_usage: float,
    prefix_cache_hit_rate: float,
) -> str:
    """vLLM's periodic summary; usage and hit rate are fractions shown as percentages."""
    return (
        f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
        f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
        f"Running: {num_running_reqs} reqs, Waiting: {num_waiting_reqs} reqs, "
        f"KV cache usage: {kv_cache_usage * _PERCENT:.1f}%, "
        f"Prefix cache hit rate: {prefix_cache_hit_rate * _PERCENT:.1f}%"
    )


class GenThroughputMeter:
    """Decode tokens per second over the interval since the last `take()` (the decode-log interval)."""

    def __init__(self, now: float | None = None) -> None:
        self._tokens = 0
        self._since = time.monotonic() if now is None else now

    def add(self, num_tokens: int) -> None:
        self._tokens += num_tokens

    def take(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        elapsed = now - self._since
        rate = self._tokens / elapsed if elapsed > 0 else 0.0
        self._tokens = 0
        self._since = now
        return rate


class PrefixHitWindow:
    """Prefix-cache hit rate over the most recent `max_requests` requests, as vLLM computes it: one entry per
    prefill batch (requests, queried tokens, hit tokens); the oldest entries drop out while the remaining
    ones still cover `max_requests` requests."""

    def __init__(self, max_requests: int = HIT_RATE_WINDOW_REQUESTS) -> None:
        self._max = max_requests
        self._entries: deque[tuple[int, int, int]] = deque()
        self._requests = self._queries = self._hits = 0

    def add(self, requests: int, queries: int, hits: int) -> None:
        self._entries.append((requests, queries, hits))
        self._requests += requests
        self._queries += queries
        self._hits += hits
        while len(self._entries) > 1 and self._requests - self._entries[0][0] >= self._max:
            old_requests, old_queries, old_hits = self._entries.popleft()
            self._requests -= old_requests
            self._queries -= old_queries
            self._hits -= old_hits

    def hit_rate(self) -> float:
        """Hit tokens / queried tokens; 0 before any query."""
        return self._hits / self._queries if self._queries else 0.0


class StatsSummaryLogger:
    """The vLLM-shaped summary every `interval` seconds while the scheduler is not idle.

    Per step the scheduler calls `on_prefill` / `on_decode` (integer adds) and once per loop iteration
    `maybe_log`, which is a clock comparison unless the interval has passed. `maybe_log` returns the line;
    it also logs it when a `logger` was given (otherwise the caller logs it with its own logger)."""

    def __init__(
        self, interval: float, logger: logging.Logger | None = None, now: float | None = None
    ) -> None:
        self._interval = interval
        self._logger = logger
        self._last = time.monotonic() if now is None else now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._hits = PrefixHitWindow()

    def on_prefill(
        self, new_tokens: int, prefix_queries: int, prefix_hits: int, num_requests: int = 1
    ) -> None:
        """`num_requests`: requests whose prefix was looked up in this batch (the hit-rate window counts them)."""
        self._prompt_tokens += new_tokens
        self._hits.add(num_requests, prefix_queries, prefix_hits)

    def on_decode(self, num_tokens: int) -> None:
        self._generation_tokens += num_tokens

    def prefix_cache_hit_rate(self) -> float:
        return self._hits.hit_rate()

    def maybe_log(
        self, now: float | None = None, *, running: int, waiting: int, kv_usage: float
    ) -> str | None:
        """The summary line if the interval has passed and there was work in it, else None."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last
        if elapsed < self._interval:
            return None
        line = None
        if running or waiting or self._prompt_tokens or self._generation_tokens:
            line = format_summary_line(
                self._prompt_tokens / elapsed,
                self._generation_tokens / elapsed,
                running,
                waiting,
                kv_usage,
                self.prefix_cache_hit_rate(),
            )
            if self._logger is not None:
                self._logger.info(line)
        self._last = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        return line


class SpecDecodingLogger:
    """vLLM's "SpecDecoding metrics" line every `interval` seconds in which some step verified drafts: mean
    acceptance length (1 + accepted / drafts), accepted and drafted tokens and their rates, the acceptance
    rate of each draft position and overall. `add` is integer adds per verify step; the line is formatted
    only when the interval has passed."""

    def __init__(self, interval: float, max_drafts: int, now: float | None = None) -> None:
        self._interval = interval
        self._last = time.monotonic() if now is None else now
        self._per_position = [0] * max_drafts
        self._reset()

    def _reset(self) -> None:
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_position = [0] * len(self._per_position)

    def add(self, num_drafts: int, num_draft_tokens: int, accepted_per_position: Sequence[int]) -> None:
        self._drafts += num_drafts
        self._draft_tokens += num_draft_tokens
        for j, n in enumerate(accepted_per_position):
            self._per_position[j] += n
            self._accepted += n

    def maybe_line(self, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        elapsed = now - self._last
        if elapsed < self._interval:
            return None
        line = None
        if self._drafts:
            rates = ", ".join(f"{n / self._drafts:.3f}" for n in self._per_position)
            line = (
                f"SpecDecoding metrics: Mean acceptance length: {1 + self._accepted / self._drafts:.2f}, "
                f"Accepted throughput: {self._accepted / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {self._draft_tokens / elapsed:.2f} tokens/s, "
                f"Accepted: {self._accepted} tokens, Drafted: {self._draft_tokens} tokens, "
                f"Per-position acceptance rate: {rates}, "
                f"Avg Draft acceptance rate: {self._accepted / self._draft_tokens * _PERCENT:.1f}%"
            )
        self._last = now
        self._reset()
        return line
