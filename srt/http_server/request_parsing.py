"""How every route reads its request: the JSON body into its strict model, and the query string.

Bodies. A route declares `body: Annotated[Model, Depends(json_body(Model))]` instead of letting FastAPI read
it, because FastAPI decodes and validates on the event loop: an 8 MB body stalled `/health` for 0.3-0.4 s,
a prediction of 100,000 parts for 0.9 s. A body of at least OFF_LOOP_PARSE_BYTES is decoded and validated on
a worker thread instead. A thread only helps if it hands the GIL back often: Python's C JSON decoder holds it
for a whole value (a list of a million token ids is one value), so the decoder gets Python-level hooks for
numbers and objects, and validation calls StrictModel's key check (Python) once per object; each such call
is a point where the event loop can take the GIL (decoding runs about 3x slower there, off the loop). Small
bodies, nearly all of them, parse inline: a thread hop would cost more than the parse. The errors are
FastAPI's own (`json_invalid`, pydantic's list), so every route answers bad input as before.

Query strings. Every route takes exactly the query parameters its handler declares: an unknown one, or one
given twice, is a 400 naming it (the same rule as unknown body keys, srt/http_server/request_types.py).
"""

from __future__ import annotations

import asyncio
import email.message
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from srt.http_server.openai.errors import OpenAIError

# A body this large or larger is parsed on a worker thread: below it, decoding and validating take about a
# millisecond, less than the hop to a thread and back.
OFF_LOOP_PARSE_BYTES = 128 * 1024

M = TypeVar("M", bound=BaseModel)


def _int(text: str) -> int:
    """json's int parser as Python code: each call lets the event loop take the GIL."""
    return int(text)


def _float(text: str) -> float:
    return float(text)


def _object(pairs: dict) -> dict:
    return pairs


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: no content type, or application/json or application/*+json."""
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def parse_body(raw: bytes, content_type: str | None, model: type[M], yielding: bool = False) -> M:
    """`raw` decoded and validated into `model`; RequestValidationError as FastAPI would raise it.
    `yielding`: decode with the Python-level hooks (on a worker thread)."""
    data: Any = raw
    if _is_json(content_type):
        hooks = {"parse_int": _int, "parse_float": _float, "object_hook": _object} if yielding else {}
        try:
            data = json.loads(raw, **hooks)
        except json.JSONDecodeError as e:
            error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error"}
            raise RequestValidationError([{**error, "input": {}, "ctx": {"error": e.msg}}]) from None
        except (ValueError, RecursionError) as e:  # not UTF-8/16/32 text; nested past Python's stack
            error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}
            raise RequestValidationError([{**error, "input": {}, "ctx": {"error": str(e)}}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    except RecursionError:
        raise OpenAIError("the request body nests too deeply", code="invalid_value") from None


def json_body(model: type[M], optional: bool = False) -> Callable[[Request], Awaitable[M | None]]:
    """A FastAPI dependency that reads the body into `model` (None for an empty `optional` body)."""

    async def read(request: Request) -> M | None:
        raw = await request.body()
        if not raw and optional:
            return None
        if not raw:
            raise OpenAIError("the request body is empty: send a JSON object", code="invalid_value")
        content_type = request.headers.get("content-type")
        if len(raw) < OFF_LOOP_PARSE_BYTES:
            return parse_body(raw, content_type, model)
        return await asyncio.to_thread(parse_body, raw, content_type, model, True)

    return read


def declared_query_parameters(route) -> frozenset[str]:
    """The query parameter names a FastAPI route's handler and its dependencies declare (a walk of a few
    nodes, microseconds: not worth a cache)."""

    def names(dependant) -> set[str]:
        return {p.alias for p in dependant.query_params}.union(*map(names, dependant.dependencies))

    return frozenset(names(route.dependant))


async def strict_query(request: Request) -> None:
    """App-wide dependency: a query parameter the matched route does not declare, or one repeated, is a
    400 naming it."""
    route = request.scope.get("route")
    declared = declared_query_parameters(route) if route is not None else frozenset()
    counts = Counter(name for name, _ in request.query_params.multi_items())
    for name, count in counts.items():
        if name not in declared:
            known = f"; it takes {', '.join(sorted(declared))}" if declared else ""
            raise OpenAIError(
                f"`{name}` is not a query parameter of {request.url.path}{known}",
                param=name,
                code="invalid_value",
            )
        if count > 1:
            raise OpenAIError(
                f"query parameter `{name}` is given {count} times", param=name, code="invalid_value"
            )
