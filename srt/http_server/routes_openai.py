"""The OpenAI routes: chat completions, responses, completions and the model list (/v1/embeddings is
installed by `serving_embedding.install_embedding_routes`, on an embedding server only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from srt.http_server.openai.protocol import ChatCompletionRequest, CompletionRequest
from srt.http_server.openai.responses_protocol import ResponsesRequest
from srt.http_server.openai.serving_chat import ChatHandler
from srt.http_server.openai.serving_common import model_not_found
from srt.http_server.openai.serving_completions import CompletionHandler
from srt.http_server.openai.serving_responses import ResponsesHandler
from srt.http_server.request_parsing import json_body
from srt.http_server.server_info import adapter_card, model_card
from srt.http_server.tokenizer_manager import TokenizerManager

# Every body is read by request_parsing.json_body: large ones are parsed off the event loop.
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]
ResponsesBody = Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))]
CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]


def openai_router(tm: TokenizerManager, model_name: str, chat: ChatHandler, created: int) -> APIRouter:
    """`chat` is shared with the tokenizer routes (its tool parser); `created`: the models' creation time."""
    router = APIRouter()
    completions = CompletionHandler(tm, model_name)
    responses = ResponsesHandler(chat)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        return await chat.handle(body, request)

    @router.post("/v1/responses")
    async def v1_responses(body: ResponsesBody, request: Request):
        return await responses.handle(body, request)

    @router.post("/v1/completions")
    async def v1_completions(body: CompletionBody, request: Request):
        return await completions.handle(body, request)

    @router.get("/v1/models")
    async def models():
        cards = [model_card(model_name, created, tm.context_len)]
        if tm.lora is not None:  # each served adapter under its base (vLLM's `parent`)
            cards += [adapter_card(a, model_name, created, tm.context_len) for a in tm.lora.served()]
        return {"object": "list", "data": cards}

    @router.get("/v1/models/{model:path}")  # `path`: served names may hold slashes (org/name)
    async def retrieve_model(model: str):
        for card in (await models())["data"]:
            if card["id"] == model:  # an empty name never matches: here it is the resource asked for
                return card
        return model_not_found(model, model_name).to_response()

    return router
