"""`POST /v1/embeddings` on an embedding server (--is-embedding; docs/embeddings.md), OpenAI's shapes.

Each input is one internal request through the usual ring, prefilled and never decoded: the scheduler pools
its final hidden states into an L2-normalized vector (srt/scheduler/pooling.py), which comes back as
little-endian float32 bytes with the request's final output. Its prompt tokens are counted like any other
request's (usage, `sglang:prompt_tokens_total`, one finished request, 0 generation tokens).

A server is either an embedding server or a generating one: `RouteKindMiddleware` answers a route of the other
kind with a 400 saying which flag serves it, before its body is read.
"""

from __future__ import annotations

import base64
import struct
import uuid
from http import HTTPStatus
from typing import Annotated, ClassVar, Literal

from fastapi import Depends, FastAPI, Request
from pydantic import BeforeValidator

from srt.http_server.input_processor import GenerateInput, InvalidRequestError
from srt.http_server.middleware import reply_error
from srt.http_server.openai.errors import OpenAIError
from srt.http_server.openai.protocol import Identifier
from srt.http_server.openai.serving_common import ChoiceAcc, collect_response, resolve_model, to_openai_error
from srt.http_server.request_parsing import json_body
from srt.http_server.request_types import RequestBody, prompt_list
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

EMBEDDINGS_PATH = "/v1/embeddings"
# The routes that generate text, refused on an embedding server (/v1/responses where it is served).
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses")


class EmbeddingRequest(RequestBody):
    route: ClassVar[str] = EMBEDDINGS_PATH
    refused: ClassVar[dict[str, str]] = {
        "dimensions": "this model has no Matryoshka truncation: its embeddings always have the hidden size's "
        "dimensions",
    }

    # A string, a list of strings, token ids or a list of token-id lists: one vector per input, in order.
    input: Annotated[list, BeforeValidator(lambda v: prompt_list(v, "input"))]
    model: str | None = None
    # OpenAI's client asks for base64 unless told otherwise, and decodes it as little-endian float32.
    encoding_format: Literal["float", "base64"] | None = None
    user: Identifier | None = None  # OpenAI only logs it, bounded as on the chat and completions routes


# Read by request_parsing.json_body, as every body (large ones are parsed off the event loop).
EmbeddingBody = Annotated[EmbeddingRequest, Depends(json_body(EmbeddingRequest))]


def encode_embedding(raw: bytes, encoding_format: str) -> list[float] | str:
    """A vector as OpenAI answers it: a list of floats, or the base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(raw).decode("ascii")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


class EmbeddingHandler:
    def __init__(self, tm: TokenizerManager, model_name: str):
        self.tm = tm
        self.model_name = model_name

    async def _input_ids(self, req: EmbeddingRequest) -> tuple[list[list[int]], list[str | None]]:
        """Each input's token ids (texts tokenized with the model's special tokens, as the chat and
        completions routes do) and its text, refused by size and vocabulary naming `input`."""
        inputs = self.tm.inputs
        inputs.check_input_chars(sum(len(p) for p in req.input if isinstance(p, str)), "input")
        ids, texts = [], []
        for i, p in enumerate(req.input):
            seq = await inputs.encode(p, "input") if isinstance(p, str) else list(p)
            if not seq:
                raise InvalidRequestError(f"input {i} has no tokens", "input")
            inputs.check_token_ids(seq, "input")
            if len(seq) > inputs.max_req_input_len:
                raise InvalidRequestError(
                    f"input {i} has {len(seq)} tokens, more than this server's maximum input length of "
                    f"{inputs.max_req_input_len} tokens",
                    "input",
                )
            ids.append(seq)
            texts.append(p if isinstance(p, str) else None)
        return ids, texts

    async def handle(self, req: EmbeddingRequest, request: Request):
        try:
            lora = resolve_model(self.tm, req.model, self.model_name)
            ids, texts = await self._input_ids(req)
            obj = GenerateInput(
                prompts=ids,
                sampling_params=SamplingParams(max_new_tokens=0),  # a prefill whose result is the vector
                rid=uuid.uuid4().hex,
                input_texts=texts,
                lora_name=lora,
            )
            outputs = self.tm.generate(obj, request)
        except Exception as e:
            return to_openai_error(e).to_response()
        fmt = req.encoding_format or "float"
        return await collect_response(
            self.tm, outputs, len(ids), lambda choices: self._response(choices, fmt)
        )

    def _response(self, choices: list[ChoiceAcc], encoding_format: str) -> dict:
        prompt_tokens = sum(c.prompt_tokens for c in choices)
        return {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": encode_embedding(c.embedding, encoding_format),
                }
                for i, c in enumerate(choices)
            ],
            "model": self.model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }


class RouteKindMiddleware:
    """A 400 for the routes of the other kind of server (pure ASGI, before the body is read): on an embedding
    server the generation routes, on a generating one /v1/embeddings, each naming the flag that serves it."""

    def __init__(self, app, is_embedding: bool):
        self.app = app
        if is_embedding:
            message = "this server serves embeddings (--is-embedding): it generates no text; use POST /v1/embeddings"
            self.refused = dict.fromkeys(GENERATION_PATHS, message)
        else:
            message = (
                "this server generates text: embeddings are served by a server started with --is-embedding"
            )
            self.refused = {EMBEDDINGS_PATH: message}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            message = self.refused.get(scope["path"].rstrip("/"))
            if message is not None:
                err = OpenAIError(message, status=HTTPStatus.BAD_REQUEST, code="unsupported_route")
                await reply_error(err, scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_embedding_routes(app: FastAPI, tm: TokenizerManager, server_args: ServerArgs) -> None:
    """POST /v1/embeddings on an embedding server (a generating one neither lists nor serves it), and the
    refusal of the other kind's routes. Call before srt's middlewares are installed, so the API key and the
    body limit are checked first."""
    app.add_middleware(RouteKindMiddleware, is_embedding=server_args.is_embedding)
    if not server_args.is_embedding:
        return
    handler = EmbeddingHandler(tm, server_args.model_name)

    async def embeddings(body: EmbeddingBody, request: Request):
        return await handler.handle(body, request)

    app.post(EMBEDDINGS_PATH)(embeddings)
