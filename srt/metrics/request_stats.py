"""Per-request interval arithmetic (METRICS.md "Events"), free of prometheus and of any process.

Two clocks meet here and are never mixed: `arrival_ts`, `first_token_recv_ts` and `finish_recv_ts` are the
main process's `time.monotonic()`; `queued_ts` .. `last_token_ts` are the scheduler's. Each interval is a
difference of two stamps from the same clock. An interval whose stamps are missing (a request aborted
before it was scheduled, or before its first token) is None and is not observed.

Preemption needs no special case: `scheduled_ts` is the *first* scheduling, so time lost to a preemption
during prefill lands in prefill (and TTFT); one during decode widens the gap between two token stamps and
so lands in decode, inference and that token's inter-token latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise


def _diff(end: float | None, start: float | None) -> float | None:
    if end is None or start is None:
        return None
    return end - start


@dataclass
class FinishedRequestStats:
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    finished_reason: str  # stop / length / abort / error
    arrival_ts: float  # main process: the HTTP handler received the request
    first_token_recv_ts: float | None  # main process: the first output for it arrived
    finish_recv_ts: float  # main process: the final output arrived
    queued_ts: float | None  # scheduler: put in the waiting queue
    scheduled_ts: float | None  # scheduler: first scheduled (re-scheduling after preemption does not move it)
    first_token_ts: float | None  # scheduler: stamp of the step that produced the first token
    last_token_ts: float | None  # scheduler: stamp of the step that produced the latest token
    num_retractions: int = 0
    max_tokens_param: int = 0
    n_param: int = 1

    @property
    def ttft(self) -> float | None:
        return _diff(self.first_token_recv_ts, self.arrival_ts)

    @property
    def e2e(self) -> float:
        return self.finish_recv_ts - self.arrival_ts

    @property
    def queue_time(self) -> float | None:
        return _diff(self.scheduled_ts, self.queued_ts)

    @property
    def prefill_time(self) -> float | None:
        return _diff(self.first_token_ts, self.scheduled_ts)

    @property
    def decode_time(self) -> float | None:
        return _diff(self.last_token_ts, self.first_token_ts)

    @property
    def inference_time(self) -> float | None:
        return _diff(self.last_token_ts, self.scheduled_ts)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; 0 for a one-token output, None with no output."""
        decode = self.decode_time
        if decode is None or self.generation_tokens < 1:
            return None
        if self.generation_tokens == 1:
            return 0.0
        return decode / (self.generation_tokens - 1)


def inter_token_latencies(previous_stamp: float | None, new_stamps: list[float]) -> list[float]:
    """Inter-token latencies for tokens that arrived with step stamps `new_stamps`, given the stamp of the
    request's previous token (None if these include its first). One value per token after the first, so a
    request's total is `generation_tokens - 1` observations however its tokens were batched for streaming."""
    stamps = new_stamps if previous_stamp is None else [previous_stamp, *new_stamps]
    return [b - a for a, b in pairwise(stamps)]
