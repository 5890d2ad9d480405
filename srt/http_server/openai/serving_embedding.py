"""`POST /v1/embeddings` on an embedding server (--is-embedding; docs/embeddings.md), OpenAI's shapes, and
SGLang's native `POST /encode` (`text` or `input_ids` in, `{"embedding", "meta_info"}` out) for clients of
SGLang's own API.

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
import time
import uuid
from http import HTTPStatus
from typing import Annotated, ClassVar, Literal

from fastapi import Depends, FastAPI, Request
from pydantic import BeforeValidator, PrivateAttr, model_validator

from srt.http_server.input_processor import GenerateInput, InvalidRequestError
from srt.http_server.middleware import reply_error
from srt.http_server.openai.errors import OpenAIError
from srt.http_server.openai.protocol import Identifier
from srt.http_server.openai.serving_common import ChoiceAcc, collect_response, resolve_model, to_openai_error
from srt.http_server.request_parsing import json_body
from srt.http_server.request_types import (
    FieldError,
    NativeInputIds,
    NativeTexts,
    RequestBody,
    Rid,
    prompt_list,
)
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

EMBEDDINGS_PATH = "/v1/embeddings"
ENCODE_PATH = "/encode"  # SGLang's native route; POST and PUT, as SGLang registers it
EMBEDDING_PATHS = (EMBEDDINGS_PATH, ENCODE_PATH)
NO_MATRYOSHKA = (
    "this model has no Matryoshka truncation: its embeddings always have the hidden size's dimensions"
)
# The routes that generate text, refused on an embedding server (/v1/responses where it is served).
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses")


class EmbeddingRequest(RequestBody):
    route: ClassVar[str] = EMBEDDINGS_PATH
    refused: ClassVar[dict[str, str]] = {"dimensions": NO_MATRYOSHKA}

    # A string, a list of strings, token ids or a list of token-id lists: one vector per input, in order.
    input: Annotated[list, BeforeValidator(lambda v: prompt_list(v, "input"))]
    model: str | None = None
    # OpenAI's client asks for base64 unless told otherwise, and decodes it as little-endian float32.
    encoding_format: Literal["float", "base64"] | None = None
    user: Identifier | None = None  # OpenAI only logs it, bounded as on the chat and completions routes


class EncodeRequest(RequestBody):
    """SGLang's `/encode` body (its EmbeddingReqInput, text only): exactly one of `text` (a string or a list)
    and `input_ids` (one list or a list of lists). A list in answers a list of results, one per input."""

    route: ClassVar[str] = ENCODE_PATH
    refused: ClassVar[dict[str, str]] = {
        "dimensions": NO_MATRYOSHKA,
        "image_data": "this server embeds text only",
    }

    text: NativeTexts = None
    input_ids: NativeInputIds = None
    rid: Rid | None = None
    # SGLang's: the LoRA adapter (a served adapter's name) every input runs with; none: the base model
    lora_path: str | None = None

    _batched: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_shape(cls, data, handler) -> EncodeRequest:
        """SGLang answers one object for one input and a list for a list, whatever its length."""
        req = handler(data)
        text, ids = data.get("text"), data.get("input_ids")
        req._batched = isinstance(text, list) or (bool(ids) and isinstance(ids[0], list))  # noqa: SLF001 (its own model, from its validator)
        if (req.text is None) == (req.input_ids is None):
            raise FieldError("exactly one of `text` and `input_ids` is required", "text")
        return req

    @property
    def batched(self) -> bool:
        return self._batched

    @property
    def inputs(self) -> tuple[list, str]:
        """The inputs and the field that holds them (errors name it)."""
        return (self.text, "text") if self.text is not None else (self.input_ids, "input_ids")


# Read by request_parsing.json_body, as every body (large ones are parsed off the event loop).
EmbeddingBody = Annotated[EmbeddingRequest, Depends(json_body(EmbeddingRequest))]
EncodeBody = Annotated[EncodeRequest, Depends(json_body(EncodeRequest))]


def encode_embedding(raw: bytes, encoding_format: str) -> list[float] | str:
    """A vector as OpenAI answers it: a list of floats, or the base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(raw).decode("ascii")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


class EmbeddingHandler:
    def __init__(self, tm: TokenizerManager, model_name: str):
        self.tm = tm
        self.model_name = model_name

    async def _input_ids(self, prompts: list, param: str) -> tuple[list[list[int]], list[str | None]]:
        """Each input's token ids (texts tokenized with the model's special tokens, as the chat and
        completions routes do) and its text, refused by size and vocabulary naming `param`."""
        inputs = self.tm.inputs
        inputs.check_input_chars(sum(len(p) for p in prompts if isinstance(p, str)), param)
        ids, texts = [], []
        for i, p in enumerate(prompts):
            seq = await inputs.encode(p, param) if isinstance(p, str) else list(p)
            if not seq:
                raise InvalidRequestError(f"input {i} has no tokens", param)
            inputs.check_token_ids(seq, param)
            if len(seq) > inputs.max_req_input_len:
                raise InvalidRequestError(
                    f"input {i} has {len(seq)} tokens, more than this server's maximum input length of "
                    f"{inputs.max_req_input_len} tokens",
                    param,
                )
            ids.append(seq)
            texts.append(p if isinstance(p, str) else None)
        return ids, texts

    async def _run(self, prompts: list, param: str, rid: str, lora: str | None, request: Request):
        """The inputs' prefill-only requests: the running outputs and how many there are."""
        ids, texts = await self._input_ids(prompts, param)
        obj = GenerateInput(
            prompts=ids,
            sampling_params=SamplingParams(max_new_tokens=0),  # a prefill whose result is the vector
            rid=rid,
            input_texts=texts,
            lora_name=lora,
        )
        return self.tm.generate(obj, request), len(ids)

    async def handle(self, req: EmbeddingRequest, request: Request):
        try:
            lora = resolve_model(self.tm, req.model, self.model_name)
            outputs, count = await self._run(req.input, "input", uuid.uuid4().hex, lora, request)
        except Exception as e:
            return to_openai_error(e).to_response()
        fmt = req.encoding_format or "float"
        return await collect_response(self.tm, outputs, count, lambda choices: self._response(choices, fmt))

    async def handle_encode(self, req: EncodeRequest, request: Request):
        """SGLang's `/encode`: each input's `{"embedding": [floats], "meta_info": {...}}`, a list when a list
        came in. meta_info carries SGLang's keys for a finished embedding (`id`, `finish_reason`,
        `prompt_tokens`, `completion_tokens` = 0, `cached_tokens`, `e2e_latency`)."""
        rid = req.rid or uuid.uuid4().hex
        arrival = time.monotonic()
        try:
            lora = resolve_model(self.tm, None, self.model_name, req.lora_path)
            prompts, param = req.inputs
            outputs, count = await self._run(prompts, param, rid, lora, request)
        except Exception as e:
            return to_openai_error(e).to_response()

        def results(choices: list[ChoiceAcc]):
            rids = [rid] if count == 1 else [f"{rid}-{i}" for i in range(count)]
            out = [encode_result(r, c, arrival) for r, c in zip(rids, choices, strict=True)]
            return out if req.batched else out[0]

        return await collect_response(self.tm, outputs, count, results)

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


def encode_result(rid: str, c: ChoiceAcc, arrival: float) -> dict:
    """One input's `/encode` result, SGLang's shape."""
    reason = c.finish_reason
    return {
        "embedding": encode_embedding(c.embedding, "float"),
        "meta_info": {
            "id": rid,
            "finish_reason": None if reason is None else {"type": reason.type, "matched": reason.matched},
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens,
            "e2e_latency": time.monotonic() - arrival,
        },
    }


class RouteKindMiddleware:
    """A 400 for the routes of the other kind of server (pure ASGI, before the body is read): on an embedding
    server the generation routes, on a generating one /v1/embeddings and /encode, each naming the flag that
    serves it."""

    def __init__(self, app, is_embedding: bool):
        self.app = app
        if is_embedding:
            message = (
                "this server serves embeddings (--is-embedding): it generates no text; use POST /v1/embeddings "
                "or POST /encode"
            )
            self.refused = dict.fromkeys(GENERATION_PATHS, message)
        else:
            message = (
                "this server generates text: embeddings are served by a server started with --is-embedding"
            )
            self.refused = dict.fromkeys(EMBEDDING_PATHS, message)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            message = self.refused.get(scope["path"].rstrip("/"))
            if message is not None:
                err = OpenAIError(message, status=HTTPStatus.BAD_REQUEST, code="unsupported_route")
                await reply_error(err, scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_embedding_routes(app: FastAPI, tm: TokenizerManager, server_args: ServerArgs) -> None:
    """POST /v1/embeddings and SGLang's /encode (POST and PUT) on an embedding server (a generating one neither
    lists nor serves them), and the refusal of the other kind's routes. Call before srt's middlewares are installed, so the API key and the
    body limit are checked first."""
    app.add_middleware(RouteKindMiddleware, is_embedding=server_args.is_embedding)
    if not server_args.is_embedding:
        return
    handler = EmbeddingHandler(tm, server_args.model_name)

    async def embeddings(body: EmbeddingBody, request: Request):
        return await handler.handle(body, request)

    async def encode(body: EncodeBody, request: Request):
        return await handler.handle_encode(body, request)

    app.post(EMBEDDINGS_PATH)(embeddings)
    app.api_route(ENCODE_PATH, methods=["POST", "PUT"])(encode)
