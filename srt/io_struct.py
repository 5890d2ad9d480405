"""Every message that crosses a process boundary, in one place: the contract between the processes.

Outputs are batched: the scheduler sends one `BatchTokenIDOut` per forward step and the detokenizer one
`BatchStrOut` per received batch, never one message per token per request. All messages go over ZMQ with
`send_pyobj`/`recv_pyobj` (pickle), serialized once per message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from srt.sampling.sampling_params import SamplingParams
from srt.speculative.stats import SpecRequestStats


@dataclass
class FinishReason:
    """Why a request ended. `type` is one of stop / length / abort / error (OpenAI's finish_reason for the
    first two); `matched` is the EOS/stop token id or the stop string that ended it; `param` marks an error
    that the request's own input caused."""

    type: str
    matched: int | str | None = None
    message: str | None = None
    # an `error` the request's own input caused (its constraint, named here): the client gets a 400 for it
    param: str | None = None

    def to_openai(self) -> str:
        return self.type


# ---- TokenizerManager -> Scheduler ----


@dataclass
class TraceContext:
    """Where a child process hangs its spans for one request (srt/tracing/): the W3C `traceparent` (and
    `tracestate`) of the parent span in the main process, and the trace level in force when the request
    arrived, so a child obeys `/set_trace_level` without a control message. Sent only for traced requests."""

    traceparent: str
    tracestate: str = ""
    level: int = 1


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    input_text: str | None = None
    trace: TraceContext | None = None  # only when the request is traced at level >= 2
    prediction_ids: list[int] | None = None  # OpenAI's Predicted Outputs: drafts for the verify step
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # A reasoning model's one-token end tag (docs/reasoning.md): its grammar applies after this token only
    think_end_id: int | None = None
    # With stop strings on a --reasoning-parser server: the reasoning format's name, so the detokenizer
    # matches them in the answer only (docs/reasoning.md, "Stop strings")
    stop_after_reasoning: str | None = None


@dataclass
class AbortReq:
    """Removes a request wherever it is and frees its memory. `rid=""` aborts every request. `silent`
    aborts (the request already finished on a stop string in the detokenizer) are not counted as aborts."""

    rid: str
    silent: bool = False


@dataclass
class LoadLoRAAdapterReq:
    """Load an adapter (PEFT's format) under `lora_name`; every scheduler replies with a `LoRAAdapterReqOutput`
    of the same `request_id`."""

    request_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass
class UnloadLoRAAdapterReq:
    """Unload an adapter once the requests running with it have finished (new ones are refused meanwhile)."""

    request_id: str
    lora_name: str


@dataclass
class LoRAAdapterReqOutput:
    request_id: str
    success: bool
    message: str = ""
    param: str = "lora_name"  # the request field a failure is about (the 400's OpenAI `param`)


@dataclass
class FlushCacheReq:
    pass


# ---- Scheduler -> Detokenizer -> TokenizerManager (control replies pass the detokenizer unchanged) ----


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class SchedulerReady:
    """Sent once over the start-up pipe before the HTTP server accepts traffic."""

    max_total_num_tokens: int
    max_req_input_len: int
    context_len: int
    max_running_requests: int
    attention_backend: str
    # the method the runner resolved (--quantization unset means the device's default)
    quantization: str = "none"
    # the vocabulary and stop tokens the scheduler's grammars use, so the HTTP process judges with the same
    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass
class BatchOutMeta:
    """Per-request fields both output batches carry; list index i describes `rids[i]`.

    Timestamps are the scheduler's `time.monotonic()`; only differences between them are meaningful
    (never subtract them from another process's clock). `token_ts[i]` holds one step stamp per token in
    `output_ids[i]`, so inter-token latency survives `--stream-interval` batching."""

    rids: list[str]
    output_ids: list[list[int]]  # tokens produced since the previous message for this request
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]  # total output tokens so far
    cached_tokens: list[int]
    queued_ts: list[float]
    scheduled_ts: list[float]
    first_token_ts: list[float]
    token_ts: list[list[float]]
    num_retractions: list[int]
    # Present only when some request in the batch asked for logprobs: per request, per new token.
    output_token_logprobs: list[list[float]] | None = None
    output_top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    # Prompt logprobs (`logprob_start_len`), present only when some request in the batch sends them: per
    # request None, or — once, with its first output — one entry per prompt token from logprob_start_len on
    # (None for the prompt's first token, which nothing predicts), and its top alternatives (None likewise).
    input_token_logprobs: list[list[float | None] | None] | None = None
    input_top_logprobs: list[list[list[tuple[int, float]] | None] | None] | None = None
    # Speculative decoding, present only when some entry carries figures: per request its figures
    # (srt/speculative/stats.py) with its final message, else None. From the scheduler also with each message
    # of a request with stop strings, which the detokenizer cuts where a stop string ends the output and
    # passes on with the final entry only.
    spec_stats: list[SpecRequestStats | None] | None = None
    # An embedding server's (--is-embedding), present only when some request in the batch finished with its
    # vector: per request the L2-normalized vector as little-endian float32 bytes (srt/scheduler/pooling.py),
    # else None. It passes the detokenizer untouched.
    embeddings: list[bytes | None] | None = None


@dataclass
class BatchTokenIDOut(BatchOutMeta):
    # What the detokenizer needs to turn ids into text; repeated each message (small) so it keeps no
    # per-request configuration beyond its decode state.
    skip_special_tokens: list[bool] = field(default_factory=list)
    stop_strs: list[list[str]] = field(default_factory=list)
    # Present only when some request in the batch is traced and this is its first message: its context, once,
    # so the detokenizer can hang its span under the request (None for the other requests).
    trace_contexts: list[TraceContext | None] | None = None
    # Present only when some request in the batch has one: per request the reasoning format whose thinking
    # its stop strings skip (TokenizedGenerateReqInput.stop_after_reasoning), else None.
    stop_after_reasoning: list[str | None] | None = None


@dataclass
class BatchStrOut(BatchOutMeta):
    output_strs: list[str] = field(default_factory=list)  # text delta since the previous message
