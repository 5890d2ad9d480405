"""The native (SGLang) routes that act on requests and the cache: /generate, the tokenizer routes (vLLM's and
SGLang's names), /flush_cache, /abort_request and /set_trace_level."""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from srt.function_call import ToolCallParser
from srt.http_server.input_processor import ServerUnavailableError
from srt.http_server.native_protocol import AbortRequest, FlushCacheRequest, GenerateRequest
from srt.http_server.openai.errors import SERVICE_UNAVAILABLE, OpenAIError
from srt.http_server.request_parsing import json_body
from srt.http_server.serving_native import GenerateHandler
from srt.http_server.serving_tokenize import TokenizeHandler
from srt.http_server.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.tracing.common import parse_trace_level

GenerateBody = Annotated[GenerateRequest, Depends(json_body(GenerateRequest))]
TokenizeBody = Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))]
DetokenizeBody = Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))]
AbortBody = Annotated[AbortRequest, Depends(json_body(AbortRequest))]
FlushCacheBody = Annotated[FlushCacheRequest | None, Depends(json_body(FlushCacheRequest, optional=True))]


def native_router(tm: TokenizerManager, model_name: str, tool_parser: ToolCallParser) -> APIRouter:
    """`tool_parser`: the chat handler's, so /tokenize renders a chat's tools as /v1/chat/completions does."""
    router = APIRouter()
    native = GenerateHandler(tm)
    tokens = TokenizeHandler(tm, model_name, tool_parser)

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(body: TokenizeBody):
        return await tokens.tokenize(body)

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize(body: DetokenizeBody):
        return await tokens.detokenize(body)

    @router.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        return await native.handle(body, request)

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(body: FlushCacheBody):
        try:
            out = await tm.flush_cache()
        except (TimeoutError, ServerUnavailableError) as e:
            msg = str(e) or "the scheduler did not answer"
            return OpenAIError(
                msg, status=HTTPStatus.SERVICE_UNAVAILABLE, type=SERVICE_UNAVAILABLE
            ).to_response()
        if not out.success:
            return OpenAIError(out.message or "cache not flushed: requests are running").to_response()
        return Response("Cache flushed.\n", media_type="text/plain")

    @router.post("/abort_request")
    async def abort_request(body: AbortBody):
        if body.abort_all:
            tm.abort_all()
            return {"success": True}
        return {"success": tm.abort_request(body.rid)}

    @router.api_route("/set_trace_level", methods=["GET", "POST"])
    async def set_trace_level(level: str | None = None):
        """Trace detail for requests arriving from now on: 0 off, 1 request spans, 2 + stage spans, 3 + one
        span per prefill chunk (srt/tracing/)."""
        if tm.tracer is None:
            msg = "tracing is off: start the server with --enable-trace"
            return OpenAIError(msg, code="tracing_disabled").to_response()
        try:
            tm.tracer.level = parse_trace_level(level)
        except ValueError as e:
            return OpenAIError(str(e), param="level", code="invalid_value").to_response()
        return {"success": True, "level": tm.tracer.level}

    return router
