"""The pure ASGI middlewares around the srt app: admission (draining, concurrency cap), the API key, the body
size limit, and JSON bodies labelled as forms.

Pure ASGI, never Starlette's BaseHTTPMiddleware: that one breaks disconnect detection in streams. Every
refusal is OpenAI's error object. `install_middlewares` puts them in this order, outermost first:

    AdmissionMiddleware -> ApiKeyMiddleware -> BodyLimitMiddleware -> JsonBodyMiddleware -> app

so a draining or saturated server answers 503 without reading anything, and a request without the key is
refused before its body is read.
"""

from __future__ import annotations

import asyncio
import hmac
from http import HTTPStatus

from fastapi import FastAPI

from srt.http_server.openai.errors import AUTHENTICATION, SERVICE_UNAVAILABLE, OpenAIError
from srt.server_args import ServerArgs

# Routes reachable without the API key and never refused by admission: probes and scrapers carry no
# credentials, and must answer however busy the server is.
PUBLIC_PATHS = ("/health", "/metrics")
# A body that pauses longer than this between two pieces is given up (408): only a broken or hostile client
# stalls mid-body, and each stalled request holds a connection and a slot.
BODY_READ_TIMEOUT_SECONDS = 10.0
# A client refused for load may retry after this many seconds (the Retry-After header).
RETRY_AFTER_SECONDS = 1


def is_public(scope) -> bool:
    return scope["path"].rstrip("/") in PUBLIC_PATHS


async def reply_error(err: OpenAIError, scope, receive, send, headers: dict[str, str] | None = None) -> None:
    """Answer with `err` and close the connection: the request's body, unread or half read, may follow."""
    response = err.to_response()
    response.headers.update({"connection": "close", **(headers or {})})
    await response(scope, receive, send)


class AdmissionGate:
    """Whether new requests are admitted, and how many are in flight. AdmissionMiddleware counts; the HTTP
    server closes the gate when it starts shutting down."""

    def __init__(self, max_in_flight: int):
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.closed_reason: str | None = None

    def close(self, reason: str) -> None:
        self.closed_reason = reason


class AdmissionMiddleware:
    """503 for every request (but the probes) once the server drains, or beyond the concurrency cap."""

    def __init__(self, app, gate: AdmissionGate):
        self.app = app
        self.gate = gate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_public(scope):
            return await self.app(scope, receive, send)
        gate = self.gate
        if gate.closed_reason is not None:
            err = OpenAIError(gate.closed_reason, HTTPStatus.SERVICE_UNAVAILABLE, SERVICE_UNAVAILABLE)
            return await reply_error(err, scope, receive, send)
        if gate.in_flight >= gate.max_in_flight:
            err = OpenAIError(
                f"the server is already serving its maximum of {gate.max_in_flight} concurrent requests "
                "(--max-concurrent-requests); retry later",
                HTTPStatus.SERVICE_UNAVAILABLE,
                SERVICE_UNAVAILABLE,
                code="server_overloaded",
            )
            return await reply_error(err, scope, receive, send, {"retry-after": str(RETRY_AFTER_SECONDS)})
        gate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            gate.in_flight -= 1


class ApiKeyMiddleware:
    """Exactly one `Authorization: Bearer <key>` header with the right key, compared in constant time; a
    request carrying several Authorization headers is refused whatever they say (which one would a proxy
    in front have checked?)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or is_public(scope):
            return await self.app(scope, receive, send)
        given = [v for k, v in scope.get("headers") or [] if k == b"authorization"]
        if len(given) != 1 or not hmac.compare_digest(given[0], self.expected):
            err = OpenAIError(
                "Incorrect or missing API key: send one 'Authorization: Bearer <key>' header.",
                status=HTTPStatus.UNAUTHORIZED,
                type=AUTHENTICATION,
                code="invalid_api_key",
            )
            return await reply_error(err, scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once from its Content-Length, before reading it; for a chunked
    body, as soon as the bytes received pass the limit. The body is read here, whole, and replayed to the
    app (which reads it whole anyway); a client that stalls mid-body gets 408."""

    def __init__(self, app, max_bytes: int, read_timeout: float = BODY_READ_TIMEOUT_SECONDS):
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    def _too_large(self, size: str) -> OpenAIError:
        return OpenAIError(
            f"the request body has {size} bytes; this server accepts at most {self.max_bytes} "
            "(--max-request-bytes)",
            status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            code="request_too_large",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        length = next((v for k, v in headers if k == b"content-length"), None)
        chunked = any(k == b"transfer-encoding" for k, _ in headers)
        if length is None and not chunked:
            return await self.app(scope, receive, send)  # no body
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await reply_error(self._too_large(length.decode()), scope, receive, send)
        pieces: list[bytes] = []
        size = 0
        while True:
            try:
                async with asyncio.timeout(self.read_timeout):
                    message = await receive()
            except TimeoutError:
                err = OpenAIError(
                    f"the request body stalled for {self.read_timeout:.0f} s",
                    status=HTTPStatus.REQUEST_TIMEOUT,
                    code="request_timeout",
                )
                return await reply_error(err, scope, receive, send)
            if message["type"] != "http.request":  # the client went away
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                err = self._too_large(f"more than {self.max_bytes}")
                return await reply_error(err, scope, receive, send)
            pieces.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(pieces)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: the disconnect, for streaming responses

        return await self.app(scope, replay, send)


class JsonBodyMiddleware:
    """Every POST route takes JSON, but `curl -d '{...}'` labels its body as a form: read it as JSON anyway
    (as OpenAI-compatible servers commonly do) instead of failing with a confusing validation error."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope.get("headers") or [])
            ctype = headers.get(b"content-type", b"")
            if not ctype or ctype.startswith(b"application/x-www-form-urlencoded"):
                others = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                scope = dict(scope, headers=[*others, (b"content-type", b"application/json")])
        return await self.app(scope, receive, send)


def install_middlewares(app: FastAPI, server_args: ServerArgs) -> AdmissionGate:
    """Wrap `app` in srt's middlewares (the first added ends up innermost); returns the admission gate the
    HTTP server closes on shutdown."""
    gate = AdmissionGate(server_args.max_concurrent_requests)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server_args.max_request_bytes)
    if server_args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key)
    app.add_middleware(AdmissionMiddleware, gate=gate)
    return gate
