"""The FastAPI application: every HTTP route of srt, its error handling and API-key guard.

The app holds no model: it talks to the scheduler only through the TokenizerManager.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from srt.http_server.input_processor import GenerateInput, ServerUnavailableError
from srt.http_server.load_report import LOAD_SECTIONS, LoadReportMiddleware, loads_body, unknown_sections
from srt.http_server.lora_registry import AdapterRequestError
from srt.http_server.middleware import install_middlewares
from srt.http_server.native_protocol import (
    AbortRequest,
    FlushCacheRequest,
    GenerateRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from srt.http_server.openai.errors import (
    SERVER_ERROR,
    SERVICE_UNAVAILABLE,
    OpenAIError,
    status_error,
    validation_error,
)
from srt.http_server.openai.protocol import ChatCompletionRequest, CompletionRequest
from srt.http_server.openai.responses_protocol import ResponsesRequest
from srt.http_server.openai.serving_chat import ChatHandler
from srt.http_server.openai.serving_common import model_not_found
from srt.http_server.openai.serving_completions import CompletionHandler
from srt.http_server.openai.serving_embedding import install_embedding_routes
from srt.http_server.openai.serving_responses import ResponsesHandler
from srt.http_server.request_parsing import json_body, strict_query
from srt.http_server.server_info import adapter_card, model_card, model_info, server_info, tokenizer_info
from srt.http_server.serving_native import GenerateHandler
from srt.http_server.serving_tokenize import TokenizeHandler
from srt.http_server.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.metrics.load_snapshot import SchedulerLoadReader
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.tracing.common import parse_trace_level
from srt.tracing.http import ReceivedTimeMiddleware

logger = logging.getLogger(__name__)

# Every body is read by request_parsing.json_body: large ones are parsed off the event loop.
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]
ResponsesBody = Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))]
CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
GenerateBody = Annotated[GenerateRequest, Depends(json_body(GenerateRequest))]
TokenizeBody = Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))]
DetokenizeBody = Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))]
LoadAdapterBody = Annotated[LoadLoRAAdapterRequest, Depends(json_body(LoadLoRAAdapterRequest))]
UnloadAdapterBody = Annotated[UnloadLoRAAdapterRequest, Depends(json_body(UnloadLoRAAdapterRequest))]
AbortBody = Annotated[AbortRequest, Depends(json_body(AbortRequest))]
FlushCacheBody = Annotated[FlushCacheRequest | None, Depends(json_body(FlushCacheRequest, optional=True))]

# /health_generate gives up (503) if one token takes longer than this.
HEALTH_GENERATE_TIMEOUT_SECONDS = 20.0
SRT_VERSION = "0.1.0"


def create_app(tm: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    """Build the app around a TokenizerManager whose scheduler already reported ready."""
    model_name = server_args.model_name
    chat = ChatHandler(tm, model_name, server_args.tool_call_parser)
    completions = CompletionHandler(tm, model_name)
    responses = ResponsesHandler(chat)
    native = GenerateHandler(tm)
    tokens = TokenizeHandler(tm, model_name, chat.tool_parser)
    created = int(time.time())
    # load reports read the schedulers' own records, which --disable-metrics leaves in place
    load_reader = SchedulerLoadReader(tm.port_args.ipc_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await tm.start()
        yield
        # Whatever is still waiting ends now with an error, so nothing sends on the sockets stop() closes.
        tm.fail_all("the server is shutting down")
        await tm.stop()

    # strict_query: a query parameter a route does not declare is a 400, as an unknown body key is
    app = FastAPI(title="srt", version=SRT_VERSION, lifespan=lifespan, dependencies=[Depends(strict_query)])
    app.state.tokenizer_manager = tm

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return validation_error(exc).to_response()

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError):
        return exc.to_response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return status_error(
            exc.status_code, exc.detail if isinstance(exc.detail, str) else None
        ).to_response()

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return OpenAIError(
            f"internal error: {exc}", status=HTTPStatus.INTERNAL_SERVER_ERROR, type=SERVER_ERROR
        ).to_response()

    # ---- OpenAI ----
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        return await chat.handle(body, request)

    @app.post("/v1/responses")
    async def v1_responses(body: ResponsesBody, request: Request):
        return await responses.handle(body, request)

    @app.post("/v1/completions")
    async def v1_completions(body: CompletionBody, request: Request):
        return await completions.handle(body, request)

    @app.get("/v1/models")
    async def models():
        cards = [model_card(model_name, created, tm.context_len)]
        if tm.lora is not None:  # each served adapter under its base (vLLM's `parent`)
            cards += [adapter_card(a, model_name, created, tm.context_len) for a in tm.lora.served()]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model:path}")  # `path`: served names may hold slashes (org/name)
    async def retrieve_model(model: str):
        for card in (await models())["data"]:
            if card["id"] == model:  # an empty name never matches: here it is the resource asked for
                return card
        return model_not_found(model, model_name).to_response()

    # ---- embeddings (--is-embedding; docs/embeddings.md): /v1/embeddings and SGLang's /encode ----
    install_embedding_routes(app, tm, server_args)

    # ---- LoRA adapters (SGLang's routes and vLLM's /v1/ names; docs/lora.md) ----
    @app.post("/load_lora_adapter")
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterBody):
        return await lora_call(lambda registry: registry.load(body.lora_name, body.lora_path, body.pinned))

    @app.post("/unload_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterBody):
        return await lora_call(lambda registry: registry.unload(body.lora_name))

    async def lora_call(action) -> JSONResponse:
        if tm.lora is None:
            return OpenAIError(
                "LoRA is off: start the server with --enable-lora", param="lora_name"
            ).to_response()
        try:
            await action(tm.lora)
        except AdapterRequestError as e:
            status = HTTPStatus.NOT_FOUND if e.not_found else HTTPStatus.BAD_REQUEST
            return OpenAIError(str(e), status=status, param=e.param).to_response()
        except TimeoutError:
            return OpenAIError(
                "the schedulers did not answer",
                status=HTTPStatus.SERVICE_UNAVAILABLE,
                type=SERVICE_UNAVAILABLE,
            ).to_response()
        served = [a.name for a in tm.lora.served()]
        return JSONResponse({"success": True, "error_message": "", "loaded_adapters": served})

    # ---- tokenizer (vLLM's and SGLang's routes) ----
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeBody):
        return await tokens.tokenize(body)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeBody):
        return await tokens.detokenize(body)

    # ---- native ----
    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        return await native.handle(body, request)

    @app.get("/health")
    async def health():
        if tm.dead_reason is not None:
            return JSONResponse({"status": "unhealthy", "reason": tm.dead_reason}, status_code=503)
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        obj = GenerateInput(
            prompts=[await tm.inputs.encode("ping") or [0]], sampling_params=SamplingParams(max_new_tokens=1)
        )
        try:
            async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_SECONDS):
                async for out in tm.generate(obj, health_check=True):
                    if out.finish_reason is not None and out.finish_reason.type == "error":
                        raise ServerUnavailableError(out.finish_reason.message or "generation failed")
        except (TimeoutError, ServerUnavailableError) as e:
            msg = str(e) or "one-token generation timed out"
            return OpenAIError(
                msg, status=HTTPStatus.SERVICE_UNAVAILABLE, type=SERVICE_UNAVAILABLE
            ).to_response()
        return {"status": "ok"}

    # SGLang's current names (its bench_serving asks for them) beside the older /get_* ones.
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return model_info(server_args, tm.model_dir, tm.context_len)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(server_args, tm.ready, SRT_VERSION)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return tokenizer_info(tm.tokenizer, tm.context_len)

    @app.get("/v1/loads")
    @app.get("/get_loads")
    async def get_loads(include: str | None = None):
        unknown = unknown_sections(include)
        if unknown:
            msg = f"unknown load section {unknown[0]!r}: SGLang's are {', '.join(LOAD_SECTIONS)}"
            return OpenAIError(msg, param="include", code="invalid_value").to_response()
        ranks = load_reader.read_ranks()
        if ranks is None:
            return OpenAIError(
                "no scheduler has reported its load yet",
                status=HTTPStatus.SERVICE_UNAVAILABLE,
                type=SERVICE_UNAVAILABLE,
            ).to_response()
        return loads_body(ranks, tm.ready.max_running_requests if tm.ready else 0)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
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

    @app.post("/abort_request")
    async def abort_request(body: AbortBody):
        if body.abort_all:
            tm.abort_all()
            return {"success": True}
        return {"success": tm.abort_request(body.rid)}

    @app.api_route("/set_trace_level", methods=["GET", "POST"])
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

    if server_args.metrics_enabled:
        from srt.metrics.collector import instrument_http_app, make_metrics_asgi_app

        instrument_http_app(app, {"model_name": model_name})
        app.router.routes.append(Route("/metrics", endpoint=make_metrics_asgi_app()))
    app.add_middleware(LoadReportMiddleware, reader=load_reader)
    app.state.admission = install_middlewares(app, server_args)
    if server_args.enable_trace:  # outermost: a request's trace starts before its body is read
        app.add_middleware(ReceivedTimeMiddleware)
    return app
