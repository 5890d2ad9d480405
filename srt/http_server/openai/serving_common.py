"""Pieces shared by the chat, completions and native handlers: model-name check, error mapping, SSE
framing, per-choice accumulation (a chat or completions response's body, chunks and usage: `response_frame`)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi.responses import JSONResponse

from srt.http_server.input_processor import ClientDisconnected, InvalidRequestError, ServerUnavailableError
from srt.http_server.lora_registry import AdapterNotFound
from srt.http_server.openai.errors import SERVER_ERROR, SERVICE_UNAVAILABLE, OpenAIError
from srt.http_server.output_dispatch import ReqOutput
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.io_struct import FinishReason
from srt.metrics.request_stats import FinishedRequestStats
from srt.speculative.stats import SpecRequestStats

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
# nginx's non-standard status for "client closed the request": nobody reads it, but logs stay honest.
CLIENT_CLOSED_REQUEST = 499


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def model_not_found(requested: str, served: str) -> OpenAIError:
    """OpenAI's 404 for a model name this server does not serve."""
    return OpenAIError(
        f"The model `{requested}` does not exist. This server serves `{served}`.",
        status=HTTPStatus.NOT_FOUND,
        param="model",
        code="model_not_found",
    )


def check_model(requested: str | None, served: str) -> None:
    """Accept the served name (or no name); anything else is OpenAI's 404 `model_not_found`."""
    if requested and requested != served:
        raise model_not_found(requested, served)


def resolve_model(
    tm: TokenizerManager, requested: str | None, served: str, lora_path: str | None = None
) -> str | None:
    """The LoRA adapter a request runs with (None: the base model), named by its `model` (ADAPTER or
    BASE:ADAPTER) or `/generate`'s `lora_path`; a name this server does not serve is OpenAI's 404
    `model_not_found` (docs/lora.md)."""
    if tm.lora is None:
        if lora_path is not None:
            raise model_not_found(lora_path, served)
        check_model(requested, served)
        return None
    try:
        return tm.lora.resolve(requested, lora_path)
    except AdapterNotFound as e:
        raise model_not_found(str(e.args[0]), served) from None


def to_openai_error(exc: Exception) -> OpenAIError:
    """Map the TokenizerManager's exceptions to HTTP errors."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(str(exc), param=exc.param)
    if isinstance(exc, ServerUnavailableError):
        return OpenAIError(str(exc), status=HTTPStatus.SERVICE_UNAVAILABLE, type=SERVICE_UNAVAILABLE)
    raise exc


def error_finish(reason: FinishReason, tm: TokenizerManager) -> OpenAIError:
    """A request that ended with an error: a 400 naming the field when its own input caused it (a
    constraint the grammar library gave up on mid-way), a 503 if the server is going down, else a 500 — the
    request was valid (the HTTP layer validated it) and the server failed it, alone, while serving everyone
    else."""
    message = reason.message or "the request failed"
    if reason.param is not None:  # the request's own constraint could not be enforced
        return OpenAIError(message, status=HTTPStatus.BAD_REQUEST, param=reason.param)
    if tm.dead_reason is not None:
        return OpenAIError(message, status=HTTPStatus.SERVICE_UNAVAILABLE, type=SERVICE_UNAVAILABLE)
    return OpenAIError(message, status=HTTPStatus.INTERNAL_SERVER_ERROR, type=SERVER_ERROR)


@dataclass
class ChoiceAcc:
    """Accumulates one choice's deltas into its final value (non-streaming responses and usage)."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Prompt logprobs (asked with echo + logprobs, or logprob_start_len): the prompt's ids they describe.
    input_token_ids: list[int] | None = None
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    stats: FinishedRequestStats | None = None  # with the final output: the request's timings
    spec_stats: SpecRequestStats | None = None  # with the final output, if it ran verify steps
    embedding: bytes | None = None  # with the final output on an embedding server: its vector (io_struct)

    def add(self, out: ReqOutput) -> None:
        self.text += out.text
        self.output_ids.extend(out.output_ids)
        if out.token_logprobs:
            self.token_logprobs.extend(out.token_logprobs)
        if out.top_logprobs:
            self.top_logprobs.extend(out.top_logprobs)
        self.finish_reason = out.finish_reason or self.finish_reason
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.stats = out.stats or self.stats
        self.spec_stats = out.spec_stats or self.spec_stats
        self.embedding = out.embedding or self.embedding
        if out.input_token_logprobs is not None:
            self.input_token_ids = out.input_token_ids
            self.input_token_logprobs = out.input_token_logprobs
            self.input_top_logprobs = out.input_top_logprobs


def wants_timing(tm: TokenizerManager, asked: bool | None) -> bool:
    """OpenAI responses carry timings when the body asks (`return_timing`) or the server always adds them."""
    return bool(asked) or tm.server_args.return_timing


def timing(stats: FinishedRequestStats | None) -> dict | None:
    """A choice's `timing` object: the same values its request's histograms observed (docs/observability.md, "Per-request
    timings")."""
    return None if stats is None else stats.timings()


async def collect(
    tm: TokenizerManager, outputs: AsyncIterator[ReqOutput], num_choices: int
) -> list[ChoiceAcc]:
    """Run a request to completion; raises OpenAIError if any choice failed (the rest are aborted)."""
    choices = [ChoiceAcc() for _ in range(num_choices)]
    async with aclosing(outputs):
        async for out in outputs:
            choices[out.index].add(out)
            if out.finish_reason is not None and out.finish_reason.type == "error":
                raise error_finish(out.finish_reason, tm)
    return choices


async def collect_response(
    tm: TokenizerManager, outputs: AsyncIterator[ReqOutput], num_choices: int, build
) -> JSONResponse:
    """Non-streaming reply: run the request to completion and answer `build(choices)`, or the OpenAI error
    (499 with an empty body when the client has already gone)."""
    try:
        choices = await collect(tm, outputs, num_choices)
    except ClientDisconnected:
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    except Exception as e:
        return to_openai_error(e).to_response()
    return JSONResponse(build(choices))


async def stream_with_errors(
    tm: TokenizerManager,
    outputs: AsyncIterator[ReqOutput],
    on_output: Callable[[ReqOutput], list[str]],
    on_end: Callable[[], list[str]],
) -> AsyncIterator[str]:
    """SSE body: `on_output` turns each output into chunks, `on_end` adds the closing chunks; an error
    mid-stream becomes an OpenAI error event, and the stream always ends with `data: [DONE]`."""
    try:
        async with aclosing(outputs):
            async for out in outputs:
                if out.finish_reason is not None and out.finish_reason.type == "error":
                    yield sse(error_finish(out.finish_reason, tm).to_dict())
                    yield SSE_DONE
                    return
                for chunk in on_output(out):
                    yield chunk
        for chunk in on_end():
            yield chunk
    except ClientDisconnected:
        logger.info("client disconnected from a stream; request aborted")
        return
    except (InvalidRequestError, ServerUnavailableError) as e:
        yield sse(to_openai_error(e).to_dict())
    yield SSE_DONE


def token_text(tm: TokenizerManager, token_id: int) -> str:
    return tm.tokenizer.decode([token_id])
