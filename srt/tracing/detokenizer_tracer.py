"""The detokenizer's part of request tracing: one `detokenize` span per traced request, from its first
output message (which carries its context, once) to the message that finishes it. Per message it costs one
dict lookup per finishing entry, and nothing for requests that are not traced. This module imports the
OpenTelemetry SDK: the detokenizer imports it only with --enable-trace."""

from __future__ import annotations

import logging
import time

from srt.io_struct import BatchTokenIDOut, TraceContext
from srt.server_args import ServerArgs
from srt.tracing.common import SPAN_DETOKENIZE, TRACE_LEVEL_STAGES, WallClock
from srt.tracing.otel import Tracer

logger = logging.getLogger(__name__)


class DetokenizerTracing:
    def __init__(self, server_args: ServerArgs, tracer: Tracer | None = None):
        self.tracer = tracer or Tracer("detokenizer", server_args.otlp_traces_endpoint)
        self.open: dict[str, tuple[TraceContext, float]] = {}  # rid -> its context, first message received
        self._failures = 0

    def on_batch(self, batch: BatchTokenIDOut) -> None:
        """Remember the contexts a message brings (only messages holding a request's first entry have any)."""
        if batch.trace_contexts is None:
            return
        now = time.monotonic()
        for rid, ctx in zip(batch.rids, batch.trace_contexts, strict=False):
            if ctx is not None and ctx.level >= TRACE_LEVEL_STAGES:
                self.open[rid] = (ctx, now)

    def on_finished(self, rid: str) -> None:
        """The entry finishing `rid` was converted: its span ends now (never raises)."""
        entry = self.open.pop(rid, None)
        if entry is None:
            return
        ctx, start = entry
        try:
            clock = WallClock.now()
            end = time.monotonic()
            self.tracer.span(SPAN_DETOKENIZE, Tracer.parent_of(ctx), clock.wall_ns(start), clock.wall_ns(end))
        except Exception:
            self._failures += 1
            if self._failures == 1:
                logger.exception("tracing failed for request %s; its detokenize span is dropped", rid)
