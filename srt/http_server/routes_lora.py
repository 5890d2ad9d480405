"""The LoRA admin routes: SGLang's /load_lora_adapter and /unload_lora_adapter and vLLM's /v1/ names
(docs/lora.md). Each answers with the adapters served afterwards, or an OpenAI-style error."""

from __future__ import annotations

from http import HTTPStatus
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from srt.http_server.lora_registry import AdapterRequestError
from srt.http_server.native_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from srt.http_server.openai.errors import SERVICE_UNAVAILABLE, OpenAIError
from srt.http_server.request_parsing import json_body
from srt.http_server.tokenizer_manager import TokenizerManager

LoadAdapterBody = Annotated[LoadLoRAAdapterRequest, Depends(json_body(LoadLoRAAdapterRequest))]
UnloadAdapterBody = Annotated[UnloadLoRAAdapterRequest, Depends(json_body(UnloadLoRAAdapterRequest))]


def lora_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()

    @router.post("/load_lora_adapter")
    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterBody):
        return await lora_call(lambda registry: registry.load(body.lora_name, body.lora_path, body.pinned))

    @router.post("/unload_lora_adapter")
    @router.post("/v1/unload_lora_adapter")
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

    return router
