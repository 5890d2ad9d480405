"""The scheduler's part of request tracing: stamps while a traced request runs, spans once it is over.

Off the hot path by construction: a request carries a `ReqTrace` only when the main process sent it a
context (tracing on, level >= 2, the caller's trace sampled); the scheduler's hooks then append a few floats
(a prefill chunk at level 3, a retraction), and the queue / prefill / prefill_chunk / decode spans are built
from the request's own event stamps (`queued_ts` .. `last_token_ts`, docs/metrics.md, "Per-request
intervals") when it finishes.
Nothing is done per decode step or per token. Without --enable-trace the SDK is never imported and every
hook returns at once.

The request's context reaches the detokenizer once, in the request's first output message
(`BatchTokenIDOut.trace_contexts`), and only in messages that carry such a first entry.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from srt.io_struct import BatchTokenIDOut, TraceContext
from srt.server_args import ServerArgs
from srt.tracing.common import (
    EVENT_RETRACTION,
    SPAN_DECODE,
    SPAN_PREFILL,
    SPAN_PREFILL_CHUNK,
    SPAN_QUEUE,
    TRACE_LEVEL_DETAIL,
    SpanAttributes,
    WallClock,
)

if TYPE_CHECKING:
    from srt.scheduler.schedule_batch import Req
    from srt.tracing.otel import Tracer

logger = logging.getLogger(__name__)
A = SpanAttributes


@dataclass
class ReqTrace:
    """A traced request's context and the stamps (this process's time.monotonic()) only traces need."""

    context: TraceContext
    undelivered: bool = True  # the detokenizer has not been sent the context yet
    chunks: list[tuple[float, float, int, int]] = field(default_factory=list)  # start, end, position, tokens
    retractions: list[tuple[float, int]] = field(default_factory=list)  # when, output tokens then


class SchedulerTracing:
    """Built by the scheduler process (rank 0 only: TP peers keep the default, which records nothing)."""

    def __init__(self, tracer: Tracer | None = None):
        self.tracer = tracer
        self.undelivered = 0  # traced requests whose context has not gone to the detokenizer yet
        self._failures = 0

    @classmethod
    def create(cls, server_args: ServerArgs, dp_rank: int = 0) -> SchedulerTracing:
        if not server_args.enable_trace:
            return cls()
        from srt.tracing.otel import Tracer

        extra = {"srt.dp_rank": dp_rank} if server_args.dp_size > 1 else None
        return cls(Tracer("scheduler", server_args.otlp_traces_endpoint, resource_attributes=extra))

    # ---- hooks (cheap) ----
    def attach(self, req: Req, context: TraceContext | None) -> None:
        if context is not None and self.tracer is not None:
            req.trace = ReqTrace(context)
            self.undelivered += 1

    def on_prefill_step(self, reqs: list[Req], start: float, end: float) -> None:
        """After a prefill forward: at level 3, one chunk per traced request it extended."""
        if self.tracer is None:
            return
        for req in reqs:
            t = req.trace
            if t is not None and t.context.level >= TRACE_LEVEL_DETAIL:
                t.chunks.append((start, end, req.kv_len, req.extend_len))

    def on_retraction(self, req: Req) -> None:
        if req.trace is not None:
            req.trace.retractions.append((time.monotonic(), len(req.output_ids)))

    def on_output(self, out: BatchTokenIDOut, reqs: list[Req]) -> None:
        """The step's output message is built: hand new contexts to the detokenizer, close finished traces."""
        if self.tracer is None:
            return
        if self.undelivered:
            self._deliver_contexts(out, reqs)
        for req in reqs:
            if req.trace is not None and req.finished:
                self._finish(req)

    def _deliver_contexts(self, out: BatchTokenIDOut, reqs: list[Req]) -> None:
        """Give the detokenizer the context of each traced request whose first message this is."""
        contexts: list[TraceContext | None] = []
        for req in reqs:
            t = req.trace
            if t is not None and t.undelivered:
                t.undelivered = False
                self.undelivered -= 1
                contexts.append(t.context)
            else:
                contexts.append(None)
        out.trace_contexts = contexts

    def _finish(self, req: Req) -> None:
        """The request's final output is being sent: build its spans (never raises)."""
        t, req.trace = req.trace, None
        try:
            self._spans(req, t, time.monotonic())
        except Exception:
            self._failures += 1
            if self._failures == 1:
                logger.exception("tracing failed for request %s; its scheduler spans are dropped", req.rid)

    # ---- spans ----
    def _spans(self, req: Req, t: ReqTrace, now: float) -> None:
        """queue [queued, scheduled], prefill [scheduled, first token], decode [first token, last token], each
        ending now when the request finished (an abort, a refusal) before the stamp that would end it."""
        otel, clock = self.tracer, WallClock.now()
        parent = otel.parent_of(t.context)
        scheduled = req.scheduled_ts if req.scheduled_ts is not None else now
        otel.span(SPAN_QUEUE, parent, clock.wall_ns(req.queued_ts), clock.wall_ns(scheduled))
        if req.scheduled_ts is None:
            return
        chunks_end = max((c[1] for c in t.chunks), default=req.scheduled_ts)
        first = req.first_token_ts
        prefill = otel.start(
            SPAN_PREFILL,
            parent,
            clock.wall_ns(req.scheduled_ts),
            {A.USAGE_PROMPT_TOKENS: len(req.origin_input_ids), A.USAGE_CACHED_TOKENS: req.cached_tokens},
        )
        decode = None
        if first is not None:
            decode = otel.start(
                SPAN_DECODE, parent, clock.wall_ns(first), {A.OUTPUT_TOKENS: len(req.output_ids)}
            )
        for when, tokens in t.retractions:
            (decode or prefill).add_event(
                EVENT_RETRACTION, {A.OUTPUT_TOKENS: tokens}, timestamp=clock.wall_ns(when)
            )
        for start, end, position, tokens in t.chunks:
            # chunks after the first token re-prefill a retracted request: they belong to its decode
            host = prefill if decode is None or end <= first else decode
            otel.span(
                SPAN_PREFILL_CHUNK,
                otel.under(host),
                clock.wall_ns(start),
                clock.wall_ns(end),
                {A.CHUNK_START: position, A.CHUNK_TOKENS: tokens},
            )
        prefill.end(end_time=clock.wall_ns(first if first is not None else max(now, chunks_end)))
        if decode is not None:
            # a retracted request's re-prefill may be the last thing it did (aborted before its next token)
            decode.end(end_time=clock.wall_ns(max(req.last_token_ts or first, chunks_end)))
