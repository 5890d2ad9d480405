"""The main process's part of request tracing: the root span of each HTTP request, the `choice` spans of a
request with several internal requests, and the tokenize span.

How `n > 1` maps: one root (`llm_request`) per HTTP request, carrying what the client sees — its id, its
parameters, `finish_reasons` of every choice in choice order, and `usage` by the response's rule (each
prompt and its cache hit once, completion tokens summed over every choice). A request that the
TokenizerManager splits into several internal requests (`n > 1`, several prompts, `best_of`) gets one `choice`
span per internal request under the root, holding that choice's own rid, usage and latencies; the scheduler
and detokenizer spans of a choice hang under its `choice` span. With one internal request (the usual case)
there is no `choice` span and everything sits on the root.

The latency attributes are computed by `FinishedRequestStats`, from the same stamps `/metrics` observes: time
to first token and e2e on this process's clock from `GenerateInput.arrival_ts`, queue / prefill / decode /
inference from the scheduler's stamps carried in `BatchOutMeta`. Span times are this process's monotonic
stamps converted with one `WallClock` per request.

Nothing here may fail a request: every hook catches its own errors, logs them, and drops the trace. This
module imports the OpenTelemetry SDK: the TokenizerManager imports it only with --enable-trace.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from srt.io_struct import FinishReason, TraceContext
from srt.metrics.request_stats import FinishedRequestStats
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.tracing.common import (
    DEFAULT_TRACE_LEVEL,
    SPAN_CHOICE,
    SPAN_REQUEST,
    SPAN_TOKENIZE,
    TRACE_LEVEL_OFF,
    TRACE_LEVEL_STAGES,
    SpanAttributes,
    WallClock,
)
from srt.tracing.http import RECEIVED_TS_KEY
from srt.tracing.otel import Span, Tracer, mark_error, set_attributes

if TYPE_CHECKING:
    from srt.http_server.input_processor import GenerateInput
    from srt.http_server.req_state import ReqState

logger = logging.getLogger(__name__)
A = SpanAttributes


@dataclass
class _RequestTrace:
    """The open spans of one HTTP request and what its root span sums over its choices."""

    root: Span
    clock: WallClock
    arrival_ts: float  # main process monotonic, GenerateInput.arrival_ts
    remaining: int  # internal requests not finished yet
    choices: dict[str, Span] | None  # rid -> its `choice` span; None with a single internal request
    finish_reasons: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    first_token_recv_ts: float | None = None
    error: str | None = None


def latency_attributes(stats: FinishedRequestStats) -> dict[str, object]:
    return {
        A.LATENCY_TIME_IN_QUEUE: stats.queue_time,
        A.LATENCY_TIME_TO_FIRST_TOKEN: stats.ttft,
        A.LATENCY_E2E: stats.e2e,
        A.LATENCY_TIME_IN_MODEL_PREFILL: stats.prefill_time,
        A.LATENCY_TIME_IN_MODEL_DECODE: stats.decode_time,
        A.LATENCY_TIME_IN_MODEL_INFERENCE: stats.inference_time,
        A.NUM_RETRACTIONS: stats.num_retractions,
    }


class RequestTracer:
    """Created by the TokenizerManager only with --enable-trace. `level` is what `/set_trace_level` sets; a
    request keeps the level in force when it arrived."""

    def __init__(self, server_args: ServerArgs, tracer: Tracer | None = None):
        if tracer is None:
            tracer = Tracer("tokenizer", server_args.otlp_traces_endpoint)
        self.tracer = tracer
        self.model_name = server_args.model_name
        self.level = DEFAULT_TRACE_LEVEL
        self._by_rid: dict[str, _RequestTrace] = {}
        self._failures = 0

    # ---- hooks ----
    def begin(
        self, obj: GenerateInput, params: SamplingParams, group: str, rids: list[str], request
    ) -> list[TraceContext | None] | None:
        """Open the request's spans; returns each internal request's context for the scheduler (None below
        level 2, when the children record nothing). `request` is the Starlette request (its W3C headers and
        arrival stamp); internal probes without one (/health_generate) are not traced."""
        level = self.level
        if level == TRACE_LEVEL_OFF or request is None:
            return None
        try:
            return self._begin(obj, params, group, rids, request, level)
        except Exception:
            self._failed("starting the trace of request %s", group)
            return None

    def on_finish(self, st: ReqState, stats: FinishedRequestStats, reason: FinishReason) -> None:
        """An internal request's final output arrived; `stats` is its finished record (request_metrics.py)."""
        t = self._by_rid.pop(st.rid, None)
        if t is not None:
            try:
                self._finish(t, st, stats, reason)
            except Exception:
                self._failed("ending the trace of request %s", st.rid)

    def fail_all(self, reason: str, now: float) -> None:
        """A child died: end every open span with an error status."""
        traces = {id(t): t for t in self._by_rid.values()}.values()
        self._by_rid.clear()
        for t in traces:
            try:
                end_ns = t.clock.wall_ns(now)
                for span in (t.choices or {}).values():
                    mark_error(span, reason)
                    span.end(end_time=end_ns)
                mark_error(t.root, reason)
                t.root.end(end_time=end_ns)
            except Exception:
                self._failed("ending a trace after %s", reason)

    # ---- spans ----
    def _begin(
        self, obj: GenerateInput, params: SamplingParams, group: str, rids: list[str], request, level: int
    ) -> list[TraceContext | None] | None:
        otel, clock = self.tracer, WallClock.now()
        received = min(request.scope.get(RECEIVED_TS_KEY, obj.arrival_ts), obj.arrival_ts)
        attributes = {
            A.REQUEST_ID: group,
            A.REQUEST_MAX_TOKENS: params.max_new_tokens,
            A.REQUEST_TEMPERATURE: params.temperature,
            A.REQUEST_TOP_P: params.top_p,
            A.REQUEST_N: obj.n,
            A.RESPONSE_MODEL: self.model_name,
        }
        if obj.lora_name is not None:
            attributes[A.LORA_ADAPTER] = obj.lora_name
        root = otel.start(
            SPAN_REQUEST, otel.extract(request.headers), clock.wall_ns(received), attributes, server=True
        )
        if not root.is_recording():  # the caller's trace is not sampled: record nothing anywhere
            return None
        if level >= TRACE_LEVEL_STAGES:
            otel.span(SPAN_TOKENIZE, otel.under(root), clock.wall_ns(received), clock.wall_ns(obj.arrival_ts))
        choices = None
        spans = [root]
        if len(rids) > 1:
            under_root, start_ns = otel.under(root), clock.wall_ns(obj.arrival_ts)
            spans = [
                otel.start(SPAN_CHOICE, under_root, start_ns, {A.REQUEST_ID: rid, A.CHOICE_INDEX: k})
                for k, rid in enumerate(rids)
            ]
            choices = dict(zip(rids, spans, strict=True))
        t = _RequestTrace(root, clock, obj.arrival_ts, len(rids), choices, [""] * len(rids))
        for rid in rids:
            self._by_rid[rid] = t
        if level < TRACE_LEVEL_STAGES:
            return None
        return [otel.carry(span, level) for span in spans]

    def _finish(
        self, t: _RequestTrace, st: ReqState, stats: FinishedRequestStats, reason: FinishReason
    ) -> None:
        now = stats.finish_recv_ts
        t.finish_reasons[st.index] = reason.type
        t.completion_tokens += stats.generation_tokens
        if st.index % st.n == 0:  # usage's rule: a prompt and its cache hit count once, with its first choice
            t.prompt_tokens += stats.prompt_tokens
            t.cached_tokens += stats.cached_tokens
        t.num_retractions += stats.num_retractions
        if stats.first_token_recv_ts is not None:
            first = stats.first_token_recv_ts
            t.first_token_recv_ts = (
                first if t.first_token_recv_ts is None else min(t.first_token_recv_ts, first)
            )
        if reason.type == "error":
            t.error = reason.message or "error"
        end_ns = t.clock.wall_ns(now)
        t.remaining -= 1
        if t.choices is not None:
            span = t.choices.pop(st.rid)
            set_attributes(span, latency_attributes(stats))
            set_attributes(
                span, self._usage(stats.prompt_tokens, stats.generation_tokens, stats.cached_tokens)
            )
            span.set_attribute(A.RESPONSE_FINISH_REASONS, [reason.type])
            if reason.type == "error":
                mark_error(span, t.error)
            span.end(end_time=end_ns)
        if t.remaining > 0:
            return
        if t.choices is None:
            set_attributes(t.root, latency_attributes(stats))
        else:  # the request as the client saw it; the choices hold the scheduler's intervals
            ttft = None if t.first_token_recv_ts is None else t.first_token_recv_ts - t.arrival_ts
            set_attributes(
                t.root,
                {
                    A.LATENCY_TIME_TO_FIRST_TOKEN: ttft,
                    A.LATENCY_E2E: now - t.arrival_ts,
                    A.NUM_RETRACTIONS: t.num_retractions,
                },
            )
        set_attributes(t.root, self._usage(t.prompt_tokens, t.completion_tokens, t.cached_tokens))
        t.root.set_attribute(A.RESPONSE_FINISH_REASONS, t.finish_reasons)
        if t.error is not None:
            mark_error(t.root, t.error)
        t.root.end(end_time=end_ns)

    @staticmethod
    def _usage(prompt: int, completion: int, cached: int) -> dict[str, object]:
        return {
            A.USAGE_PROMPT_TOKENS: prompt,
            A.USAGE_COMPLETION_TOKENS: completion,
            A.USAGE_CACHED_TOKENS: cached,
        }

    def _failed(self, what: str, arg: str) -> None:
        """Log the first failure with its traceback, later ones in one line: tracing must never fail a request."""
        self._failures += 1
        if self._failures == 1:
            logger.exception("tracing failed while " + what, arg)
        else:
            logger.warning("tracing failed while " + what + " (%d failures so far)", arg, self._failures)
