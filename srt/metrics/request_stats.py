"""Per-request interval arithmetic (docs/metrics.md, "Per-request intervals"), free of prometheus and of any
process.

Two clocks meet here and are never mixed: `arrival_ts`, `first_token_recv_ts` and `finish_recv_ts` are the
main process's `time.monotonic()`; `queued_ts` .. `last_token_ts` are the scheduler's. Each interval is a
difference of two stamps from the same clock. An interval whose stamps are missing (a request aborted
before it was scheduled, or before its first token) is None and is not observed.

Preemption needs no special case: `scheduled_ts` is the *first* scheduling, so time lost to a preemption
during prefill lands in prefill (and TTFT); one during decode widens the gap between two token stamps and
so lands in decode, inference and that token's inter-token latency.

This record is the only per-request timing record: the histograms observe its properties, and the timings in
responses (`timings()`) and the request export read the very same properties, so the three views agree by
construction (docs/observability.md, "Per-request timings"). Wall-clock stamps (`request_received_ts`,
`response_sent_to_client_ts`) are the only epoch values: the first is the main process's monotonic arrival
moved onto the wall clock by `wall_offset` (taken once, at finish), the second is stamped when the final
output is handed to the HTTP response.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from srt.speculative.stats import SpecRequestStats


@dataclass(slots=True)
class TokenStamps:
    """The request metrics recorder's own per-request stamps, kept beside the request's state rather than
    written into it: when its first output reached the main process (main clock) and the scheduler's stamp
    of its latest token (the base of the next inter-token latency)."""

    first_token_recv_ts: float | None = None
    last_token_ts: float | None = None
    # On a --reasoning-parser server, a request's output read as it arrives (a ReasoningTracker)
    reasoning: object | None = None


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
    # time.time() - time.monotonic() in the main process at finish: turns its monotonic stamps into epoch.
    wall_offset: float = 0.0
    # Epoch seconds at which the final output was handed to the HTTP response; None until then (or never,
    # for a request whose client went away).
    response_sent_ts: float | None = None
    # What the request was, for the request export: its id, scalar sampling parameters, custom labels.
    rid: str = ""
    params: dict | None = None
    labels: dict[str, str] | None = None
    # its speculative figures (srt/speculative/stats.py) when it ran verify steps
    spec: SpecRequestStats | None = None
    lora_name: str | None = None  # the LoRA adapter it ran with
    # On a --reasoning-parser server: its output tokens through the end of the thinking (usage's
    # reasoning_tokens), and when its first answer text arrived (main process); None when not read.
    reasoning_tokens: int | None = None
    first_answer_recv_ts: float | None = None

    @property
    def ttft(self) -> float | None:
        return _diff(self.first_token_recv_ts, self.arrival_ts)

    @property
    def time_to_first_answer_token(self) -> float | None:
        """From the HTTP arrival to the first answer text after the thinking (main-process clock)."""
        return _diff(self.first_answer_recv_ts, self.arrival_ts)

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

    @property
    def decode_throughput(self) -> float | None:
        """Output tokens per second after the first: 1 / TPOT (None when there is no decode interval)."""
        decode = self.decode_time
        if decode is None or decode <= 0 or self.generation_tokens < 2:
            return None
        return (self.generation_tokens - 1) / decode

    @property
    def request_received_ts(self) -> float:
        return self.arrival_ts + self.wall_offset

    def timings(self) -> dict[str, float | int | None]:
        """The per-request timings of responses and of the request export, SGLang's `meta_info` names first;
        None where the interval is undefined for this request (see the module docstring)."""
        return {
            "e2e_latency": self.e2e,
            "queue_time": self.queue_time,
            "prefill_latency": self.prefill_time,
            "inference_time": self.inference_time,
            "decode_throughput": self.decode_throughput,
            "cached_tokens": self.cached_tokens,
            "total_retractions": self.num_retractions,
            "request_received_ts": self.request_received_ts,
            "response_sent_to_client_ts": self.response_sent_ts,
            "time_to_first_token": self.ttft,
            "decode_latency": self.decode_time,
            "time_per_output_token": self.tpot,
            **self._reasoning_timings(),
        }

    def _reasoning_timings(self) -> dict:
        """On a --reasoning-parser server only (others' timings keep their keys)."""
        if self.reasoning_tokens is None:
            return {}
        return {"time_to_first_answer_token": self.time_to_first_answer_token}

    def export_record(self) -> dict:
        """One line of the request export (srt/metrics/request_export.py): the request, its counts and
        every timing of `timings()`, the same values the response reported."""
        return {
            "rid": self.rid,
            "finish_ts": self.finish_recv_ts + self.wall_offset,
            "finish_reason": self.finished_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generation_tokens,
            "n": self.n_param,
            "max_tokens": self.max_tokens_param,
            "params": self.params or {},
            "labels": self.labels or {},
            **self.timings(),
            **({"spec_decoding": self.spec.vllm_block()} if self.spec is not None else {}),
            **(
                {"prediction": self.spec.prediction_usage()}
                if self.spec is not None and self.spec.prediction_draft_tokens
                else {}
            ),
            **({"lora_name": self.lora_name} if self.lora_name is not None else {}),
            **({"reasoning_tokens": self.reasoning_tokens} if self.reasoning_tokens is not None else {}),
        }


def inter_token_latencies(previous_stamp: float | None, new_stamps: list[float]) -> list[float]:
    """Inter-token latencies for tokens that arrived with step stamps `new_stamps`, given the stamp of the
    request's previous token (None if these include its first). One value per token after the first, so a
    request's total is `generation_tokens - 1` observations however its tokens were batched for streaming."""
    stamps = new_stamps if previous_stamp is None else [previous_stamp, *new_stamps]
    return [b - a for a, b in pairwise(stamps)]
