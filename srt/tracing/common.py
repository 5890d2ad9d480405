"""The parts of request tracing that need no OpenTelemetry: trace levels, span and attribute names, the clock
conversion and the exporter configuration. Importing this module costs nothing, tracing on or off."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from srt.child_startup import ConfigError

# ---- levels (SGLang's /set_trace_level range; cumulative) ----
TRACE_LEVEL_OFF = 0  # nothing is recorded or exported
TRACE_LEVEL_REQUEST = 1  # the root span of each request (and its `choice` spans) with every gen_ai attribute
TRACE_LEVEL_STAGES = 2  # + tokenize, queue, prefill, decode and detokenize spans in the processes doing them
TRACE_LEVEL_DETAIL = 3  # + one span per prefill chunk
MAX_TRACE_LEVEL = TRACE_LEVEL_DETAIL
# --enable-trace starts at level 1: one span per request is cheap enough to leave on; more is asked for.
DEFAULT_TRACE_LEVEL = TRACE_LEVEL_REQUEST


def parse_trace_level(value: str | None) -> int:
    """The level of `/set_trace_level?level=...`; ValueError (a 400) for anything but 0..3."""
    text = (value or "").strip()
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_TRACE_LEVEL:
        # SGLang reads the level from the query string only: a JSON body alone is told so, not ignored
        shown = "none in the query string (?level=N)" if value is None else repr(value)
        raise ValueError(f"level must be an integer from 0 to {MAX_TRACE_LEVEL}, got {shown}")
    return int(text)


# ---- names ----
SPAN_REQUEST = "llm_request"  # vLLM's name for the request span
SPAN_CHOICE = "choice"
SPAN_TOKENIZE = "tokenize"
SPAN_QUEUE = "queue"
SPAN_PREFILL = "prefill"
SPAN_PREFILL_CHUNK = "prefill_chunk"
SPAN_DECODE = "decode"
SPAN_DETOKENIZE = "detokenize"
EVENT_RETRACTION = "retraction"

# Resource attribute telling the processes apart (with the standard process.pid).
ATTR_COMPONENT = "srt.component"
SERVICE_NAME = "srt"  # unless OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES name the service


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing.py), so dashboards built on vLLM's traces read srt's."""

    REQUEST_ID = "gen_ai.request.id"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_N = "gen_ai.request.n"
    RESPONSE_MODEL = "gen_ai.response.model"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # srt's own
    CHOICE_INDEX = "srt.choice.index"
    NUM_RETRACTIONS = "srt.num_retractions"
    CHUNK_START = "srt.prefill.chunk_start"  # prompt position of the chunk's first token
    CHUNK_TOKENS = "srt.prefill.chunk_tokens"
    OUTPUT_TOKENS = "srt.output_tokens"  # tokens the request had when the event happened / the span ended
    LORA_ADAPTER = "srt.lora.adapter"  # the LoRA adapter the request ran with (absent: the base model)


# ---- clocks ----
@dataclass(frozen=True)
class WallClock:
    """Turns this process's `time.monotonic()` stamps into the epoch nanoseconds OTLP wants, with one
    wall-minus-monotonic offset taken once (when a request's spans start): every span converted with the same
    instance keeps the exact monotonic duration (every interval comes from one process's monotonic clock:
    docs/metrics.md, "Clocks"), and a wall-clock step between two requests moves neither's durations."""

    offset_ns: int

    @classmethod
    def now(cls) -> WallClock:
        return cls(time.time_ns() - time.monotonic_ns())

    def wall_ns(self, monotonic_s: float) -> int:
        return round(monotonic_s * 1e9) + self.offset_ns


# ---- exporter configuration ----
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
DEFAULT_PROTOCOL = PROTOCOL_GRPC  # the OpenTelemetry default, and SGLang's
OTLP_HTTP_TRACES_PATH = "/v1/traces"


def exporter_protocol() -> str:
    protocol = os.environ.get(PROTOCOL_ENV, "").strip() or DEFAULT_PROTOCOL
    if protocol not in (PROTOCOL_GRPC, PROTOCOL_HTTP):
        raise ConfigError(
            f"{PROTOCOL_ENV}={protocol!r} is not supported: use {PROTOCOL_GRPC} or {PROTOCOL_HTTP}"
        )
    return protocol


def exporter_endpoint(endpoint: str, protocol: str) -> str:
    """The exporter's endpoint for `--otlp-traces-endpoint host:port` (SGLang's form) or a full URL. gRPC
    without a scheme is plaintext, as a local collector expects (`https://` for TLS); OTLP/HTTP gets the
    standard `/v1/traces` path unless the URL has a path of its own."""
    endpoint = endpoint.strip()
    if not endpoint:
        raise ConfigError("--otlp-traces-endpoint is empty: give the collector's host:port")
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    if protocol == PROTOCOL_HTTP and urlsplit(url).path in ("", "/"):
        url = url.rstrip("/") + OTLP_HTTP_TRACES_PATH
    return url
