"""The scheduler's log lines (METRICS.md "Log lines"), in the exact shapes operators grep for.

No prometheus here: the lines are written with `--disable-metrics` too.
"""

from __future__ import annotations

import logging
import time
from collections import deque

# Requests over which the summary's prefix-cache hit rate is computed (vLLM's window).
HIT_RATE_WINDOW_REQUESTS = 1000
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
_PERCENT = 100.0


def format_prefill_line(
    num_new_seqs: int,
    num_new_tokens: int,
    num_cached_tokens: int,
    token_usage: float,
    num_running_reqs: int,
    num_queue_reqs: int,
) -> str:
    return (
        f"Prefill batch. #new-seq: {num_new_seqs}, #new-token: {num_new_tokens}, "
        f"#cached-token: {num_cached_tokens}, token usage: {token_usage:.2f}, "
        f"#running-req: {num_running_reqs}, #queue-req: {num_queue_reqs}"
    )


def format_decode_line(
    num_running_reqs: int, num_tokens: int, token_usage: float, gen_throughput: float, num_queue_reqs: int
) -> str:
    return (
        f"Decode batch. #running-req: {num_running_reqs}, #token: {num_tokens}, "
        f"token usage: {token_usage:.2f}, gen throughput (token/s): {gen_throughput:.2f}, "
        f"#queue-req: {num_queue_reqs}"
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


def rank_tag(tp_rank: int = 0, dp_rank: int | None = None) -> str:
    """`TP0`, or `DP1 TP0` when data parallel."""
    return f"TP{tp_rank}" if dp_rank is None else f"DP{dp_rank} TP{tp_rank}"


def make_log_formatter(prefix: str) -> logging.Formatter:
    """`[2025-01-01 12:00:00 TP0] message`: the time and the process's rank on every line."""
    return logging.Formatter(f"[%(asctime)s {prefix}] %(message)s", datefmt=LOG_DATE_FORMAT)


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


class StatsSummaryLogger:
    """The vLLM-shaped summary every `interval` seconds while the scheduler is not idle.

    Per step the scheduler calls `record_prefill` / `record_decode` (integer adds), per finished request
    `record_finished_request`, and once per loop iteration `maybe_log`, which is a clock comparison unless
    the interval has passed."""

    def __init__(
        self, interval: float, logger: logging.Logger | None = None, now: float | None = None
    ) -> None:
        self._interval = interval
        self._logger = logger or logging.getLogger(__name__)
        self._last = time.monotonic() if now is None else now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._recent: deque[tuple[int, int]] = deque(maxlen=HIT_RATE_WINDOW_REQUESTS)
        self._recent_prompt = 0
        self._recent_cached = 0

    def record_prefill(self, num_tokens: int) -> None:
        self._prompt_tokens += num_tokens

    def record_decode(self, num_tokens: int) -> None:
        self._generation_tokens += num_tokens

    def record_finished_request(self, prompt_tokens: int, cached_tokens: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            old_prompt, old_cached = self._recent[0]
            self._recent_prompt -= old_prompt
            self._recent_cached -= old_cached
        self._recent.append((prompt_tokens, cached_tokens))
        self._recent_prompt += prompt_tokens
        self._recent_cached += cached_tokens

    def prefix_cache_hit_rate(self) -> float:
        """Cached / prompt tokens over the most recent requests; 0 before any."""
        return self._recent_cached / self._recent_prompt if self._recent_prompt else 0.0

    def maybe_log(
        self, num_running_reqs: int, num_waiting_reqs: int, token_usage: float, now: float | None = None
    ) -> str | None:
        """Log (and return) the summary if the interval has passed and there was work; else None."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._last
        if elapsed < self._interval:
            return None
        busy = num_running_reqs or num_waiting_reqs or self._prompt_tokens or self._generation_tokens
        line = None
        if busy:
            line = format_summary_line(
                self._prompt_tokens / elapsed,
                self._generation_tokens / elapsed,
                num_running_reqs,
                num_waiting_reqs,
                token_usage,
                self.prefix_cache_hit_rate(),
            )
            self._logger.info(line)
        self._last = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        return line
