"""Turns the detokenizer's batched replies into each request's outputs.

One BatchStrOut carries a delta for many internal requests; this module stamps each request's metrics,
builds its ReqOutput and hands it to the handler's queue. It is apart from the TokenizerManager, which owns
the request states and the sockets, so that what a handler receives is defined in one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from srt.http_server.req_state import ReqState
from srt.http_server.request_metrics import RequestMetricsRecorder
from srt.io_struct import BatchStrOut, FinishReason
from srt.metrics.request_stats import FinishedRequestStats
from srt.speculative.stats import SpecRequestStats


@dataclass
class ReqOutput:
    """What a handler receives for one internal request per batch: deltas plus running totals."""

    index: int
    rid: str
    text: str
    output_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt logprobs, once (with the first output): for input_token_ids = prompt[logprob_start_len:].
    input_token_ids: list[int] | None = None
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # With the final output: the request's finished record (its timings; srt/http_server/request_metrics.py).
    stats: FinishedRequestStats | None = None
    # With the final output of a request that ran verify steps: its speculative decoding figures.
    spec_stats: SpecRequestStats | None = None
    # With the final output on an embedding server: the vector as little-endian float32 bytes (io_struct).
    embedding: bytes | None = None


def dispatch_batch(
    b: BatchStrOut,
    states: dict[str, ReqState],
    metrics: RequestMetricsRecorder,
    finish: Callable[[ReqState, FinishReason, FinishedRequestStats], None],
) -> None:
    """Deliver each known request's entry of `b` to its queue (unless abandoned), in the batch's order;
    `finish` retires a request right after its final entry, before the next entry is handled."""
    now = time.monotonic()
    for i, rid in enumerate(b.rids):
        st = states.get(rid)
        if st is None:
            continue
        new_ids = b.output_ids[i]
        reason = b.finished_reasons[i]
        metrics.on_tokens(st, b.token_ts[i], bool(new_ids), now)
        metrics.on_text(st, b.output_strs[i], new_ids, now)
        stats = None if reason is None else metrics.finished_stats(st, b, i, reason, now)
        if not st.abandoned:
            st.queue.put_nowait(
                ReqOutput(
                    index=st.index,
                    rid=rid,
                    text=b.output_strs[i],
                    output_ids=new_ids,
                    finish_reason=reason,
                    prompt_tokens=b.prompt_tokens[i],
                    completion_tokens=b.completion_tokens[i],
                    cached_tokens=b.cached_tokens[i],
                    token_logprobs=b.output_token_logprobs[i] if b.output_token_logprobs else None,
                    top_logprobs=b.output_top_logprobs[i] if b.output_top_logprobs else None,
                    **_prompt_logprobs(st, b, i),
                    stats=stats,
                    spec_stats=b.spec_stats[i] if b.spec_stats is not None else None,
                    embedding=b.embeddings[i] if b.embeddings is not None else None,
                )
            )
        if reason is not None:
            finish(st, reason, stats)


def _prompt_logprobs(st: ReqState, b: BatchStrOut, i: int) -> dict:
    """The ReqOutput fields of a request's prompt logprobs, in the one batch that carries them."""
    values = b.input_token_logprobs[i] if b.input_token_logprobs is not None else None
    if values is None:
        return {}
    tops = b.input_top_logprobs[i] if b.input_top_logprobs is not None else None
    return {
        "input_token_ids": st.logprob_ids,
        "input_token_logprobs": values,
        "input_top_logprobs": tops if tops is not None else [None] * len(values),
    }
