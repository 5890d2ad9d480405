"""OpenTelemetry request tracing (`--enable-trace`, `--otlp-traces-endpoint`, `GET /set_trace_level`).

Each process that works on a request writes its own spans through its own `BatchSpanProcessor` (export
happens on the SDK's worker thread, never on the request path): the TokenizerManager (main process) the
request's root span, the scheduler the stage spans, the detokenizer its span. They are linked by a
`TraceContext` (io_struct) that travels with the request once: main -> scheduler in
`TokenizedGenerateReqInput.trace`, scheduler -> detokenizer in the request's first `BatchTokenIDOut` entry.

Span tree of one HTTP request (levels are cumulative; the level in force when the request arrives travels
with its context, so a level change never needs a control message):

    llm_request            main         level 1  root; a caller's W3C traceparent/tracestate is continued
    ├─ tokenize            main         level 2  body parsing, validation, chat template, tokenization
    ├─ choice              main         level 1  only when the request has several internal requests
    │  │                                         (n > 1 or several prompts): one per choice
    │  ├─ queue            scheduler    level 2  queued_ts -> scheduled_ts
    │  ├─ prefill          scheduler    level 2  scheduled_ts -> first_token_ts
    │  │  └─ prefill_chunk scheduler    level 3  one per forward step that extended the prompt
    │  ├─ decode           scheduler    level 2  first_token_ts -> last_token_ts; a retraction is an event
    │  └─ detokenize       detokenizer  level 2  first output received -> final output sent
    └─ (with a single internal request the scheduler and detokenizer spans hang under llm_request itself)

Only `srt/tracing/otel.py` imports the OpenTelemetry SDK, and only processes started with `--enable-trace`
import it: with tracing off nothing here costs anything.
"""
