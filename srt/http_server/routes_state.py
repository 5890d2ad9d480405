"""The state routes: health (/health, /health_generate), what the server runs (/model_info, /server_info,
/tokenizer_info, SGLang's current names beside the older /get_* ones), the schedulers' loads (/v1/loads) and
/metrics. They read the server's state and change nothing."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse
from starlette.routing import Route

from srt.http_server.input_processor import GenerateInput, ServerUnavailableError
from srt.http_server.load_report import LOAD_SECTIONS, loads_body, unknown_sections
from srt.http_server.openai.errors import SERVICE_UNAVAILABLE, OpenAIError
from srt.http_server.server_info import model_info, server_info, tokenizer_info
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.metrics.load_snapshot import SchedulerLoadReader
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

# /health_generate gives up (503) if one token takes longer than this.
HEALTH_GENERATE_TIMEOUT_SECONDS = 20.0


def state_router(
    tm: TokenizerManager, server_args: ServerArgs, load_reader: SchedulerLoadReader, version: str
) -> APIRouter:
    """`load_reader`: the schedulers' own load records (which --disable-metrics leaves in place); `version`:
    srt's, for /server_info."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        if tm.dead_reason is not None:
            return JSONResponse({"status": "unhealthy", "reason": tm.dead_reason}, status_code=503)
        return {"status": "ok"}

    @router.get("/health_generate")
    async def health_generate():
        prompt = await tm.inputs.encode("ping") or [0]
        try:
            await generate_one_token(tm, prompt)
        except (TimeoutError, ServerUnavailableError) as e:
            msg = str(e) or "one-token generation timed out"
            return OpenAIError(
                msg, status=HTTPStatus.SERVICE_UNAVAILABLE, type=SERVICE_UNAVAILABLE
            ).to_response()
        return {"status": "ok"}

    # SGLang's current names (its bench_serving asks for them) beside the older /get_* ones.
    @router.get("/model_info")
    @router.get("/get_model_info")
    async def get_model_info():
        return model_info(server_args, tm.model_dir, tm.context_len)

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def get_server_info():
        return server_info(server_args, tm.ready, version)

    @router.get("/tokenizer_info")
    async def get_tokenizer_info():
        return tokenizer_info(tm.tokenizer, tm.context_len)

    @router.get("/v1/loads")
    @router.get("/get_loads")
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

    return router


async def generate_one_token(tm: TokenizerManager, prompt: list[int]) -> None:
    """One token after `prompt` through the whole ring (/health_generate): TimeoutError past
    HEALTH_GENERATE_TIMEOUT_SECONDS, ServerUnavailableError if the request finishes with an error."""
    obj = GenerateInput(prompts=[prompt], sampling_params=SamplingParams(max_new_tokens=1))
    async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_SECONDS):
        async for out in tm.generate(obj, health_check=True):
            if out.finish_reason is not None and out.finish_reason.type == "error":
                raise ServerUnavailableError(out.finish_reason.message or "generation failed")


def mount_metrics(app: FastAPI, model_name: str) -> None:
    """/metrics and the HTTP metrics' instrumentation (with metrics on). /metrics is the prometheus client's
    ASGI app on a plain route: no query check, no body model."""
    from srt.metrics.collector import instrument_http_app, make_metrics_asgi_app

    instrument_http_app(app, {"model_name": model_name})
    app.router.routes.append(Route("/metrics", endpoint=make_metrics_asgi_app()))
