"""The FastAPI application: srt's routers, its error handling and its middlewares (the API-key guard among them).

The routes live in one router per surface: OpenAI (`routes_openai`), native SGLang (`routes_native`), LoRA
admin (`routes_lora`), state, health and metrics (`routes_state`). The app holds no model: it talks to the
scheduler only through the TokenizerManager.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from srt.http_server.load_report import LoadReportMiddleware
from srt.http_server.middleware import install_middlewares
from srt.http_server.openai.errors import SERVER_ERROR, OpenAIError, status_error, validation_error
from srt.http_server.openai.serving_chat import ChatHandler
from srt.http_server.openai.serving_embedding import install_embedding_routes
from srt.http_server.request_parsing import strict_query
from srt.http_server.routes_lora import lora_router
from srt.http_server.routes_native import native_router
from srt.http_server.routes_openai import openai_router
from srt.http_server.routes_state import mount_metrics, state_router
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.metrics.load_snapshot import SchedulerLoadReader
from srt.server_args import ServerArgs
from srt.tracing.http import ReceivedTimeMiddleware

logger = logging.getLogger(__name__)

SRT_VERSION = "0.1.0"


def create_app(tm: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    """Build the app around a TokenizerManager whose scheduler already reported ready."""
    model_name = server_args.model_name
    chat = ChatHandler(tm, model_name, server_args.tool_call_parser)
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
    install_error_handlers(app)
    app.include_router(openai_router(tm, model_name, chat, created=int(time.time())))
    # embeddings (--is-embedding; docs/embeddings.md): /v1/embeddings and SGLang's /encode
    install_embedding_routes(app, tm, server_args)
    app.include_router(lora_router(tm))
    app.include_router(native_router(tm, model_name, chat.tool_parser))
    app.include_router(state_router(tm, server_args, load_reader, SRT_VERSION))
    if server_args.metrics_enabled:
        mount_metrics(app, model_name)
    app.add_middleware(LoadReportMiddleware, reader=load_reader)
    app.state.admission = install_middlewares(app, server_args)
    if server_args.enable_trace:  # outermost: a request's trace starts before its body is read
        app.add_middleware(ReceivedTimeMiddleware)
    return app


def install_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error object: a validation error a 400 naming the field, an HTTP error its
    status, anything unexpected a logged 500."""

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
