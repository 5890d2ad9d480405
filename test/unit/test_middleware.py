"""The ASGI middlewares (srt/http_server/middleware.py) around a stub app: API key, body size limit,
admission (draining, concurrency cap), JSON bodies labelled as forms, and their order."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request

from srt.http_server.middleware import (
    AdmissionGate,
    AdmissionMiddleware,
    BodyLimitMiddleware,
    install_middlewares,
)
from srt.server_args import ServerArgs

KEY = "sk-test"
LIMIT = 1024


def stub_app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()
        return {"bytes": len(body), "ctype": request.headers.get("content-type")}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    return app


def client(app, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://srt", **kw)


def guarded(api_key: str | None = KEY, max_request_bytes: int = LIMIT, max_concurrent: int = 8):
    app = stub_app()
    args = ServerArgs(
        api_key=api_key, max_request_bytes=max_request_bytes, max_concurrent_requests=max_concurrent
    )
    app.state.admission = install_middlewares(app, args)
    return app


def assert_openai_error(r: httpx.Response, status: int, type_: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if type_ is not None:
        assert err["type"] == type_
    return err


def run(coro):
    return asyncio.run(coro)


# ---- API key ----
def test_api_key_right_wrong_missing_and_public_paths():
    async def go():
        async with client(guarded()) as c:
            ok = await c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            wrong = await c.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
            prefix = await c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}x"})
            missing = await c.get("/v1/models")
            health = await c.get("/health")
        return ok, wrong, prefix, missing, health

    ok, wrong, prefix, missing, health = run(go())
    assert ok.status_code == 200
    for r in (wrong, prefix, missing):
        assert assert_openai_error(r, 401, "authentication_error")["code"] == "invalid_api_key"
    assert health.status_code == 200


@pytest.mark.parametrize("second", [f"Bearer {KEY}", "Bearer sk-wrong"], ids=["both-right", "one-wrong"])
def test_two_authorization_headers_are_refused(second):
    async def go():
        async with client(guarded()) as c:
            headers = httpx.Headers([("Authorization", f"Bearer {KEY}"), ("Authorization", second)])
            return await c.get("/v1/models", headers=headers)

    assert_openai_error(run(go()), 401, "authentication_error")


@pytest.mark.parametrize("verdict", [True, False])
def test_the_key_is_judged_by_the_constant_time_comparison_alone(monkeypatch, verdict):
    """Timing can't be measured reliably here; what can: each request's key goes to `hmac.compare_digest`
    (with the expected value) and its verdict alone decides, with no early comparison that could leak."""
    import hmac

    calls = []

    def compare_digest(a, b):
        calls.append((a, b))
        return verdict

    monkeypatch.setattr(hmac, "compare_digest", compare_digest)

    async def go():
        async with client(guarded()) as c:
            right = await c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            wrong = await c.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        return right, wrong

    right, wrong = run(go())
    expected = f"Bearer {KEY}".encode()
    assert calls == [(expected, expected), (b"Bearer sk-wrong", expected)]
    for r in (right, wrong):
        assert r.status_code == (200 if verdict else 401)


# ---- body size ----
def test_body_within_the_limit_reaches_the_app_whole():
    async def go():
        async with client(guarded(api_key=None)) as c:
            sized = await c.post("/echo", content=b"x" * LIMIT)

            async def pieces():
                for _ in range(4):
                    yield b"y" * (LIMIT // 4)

            chunked = await c.post("/echo", content=pieces())
        return sized, chunked

    sized, chunked = run(go())
    assert sized.status_code == 200 and sized.json()["bytes"] == LIMIT
    assert chunked.status_code == 200 and chunked.json()["bytes"] == LIMIT


def test_content_length_over_the_limit_is_413_before_the_body_is_read():
    received = []

    async def app(scope, receive, send):  # never reached
        received.append(scope)

    async def receive():
        raise AssertionError("the body must not be read")

    sent = []

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-length", str(LIMIT + 1).encode())],
    }
    run(BodyLimitMiddleware(app, LIMIT)(scope, receive, send))
    assert not received
    start = sent[0]
    assert start["status"] == 413 and (b"connection", b"close") in start["headers"]
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]


def test_chunked_body_is_cut_once_over_the_limit():
    pulled = 0

    async def receive():
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"z" * 300, "more_body": True}  # endless

    sent = []

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        raise AssertionError("an oversized body must not reach the app")

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/generate",
        "headers": [(b"transfer-encoding", b"chunked")],
    }
    run(BodyLimitMiddleware(app, LIMIT)(scope, receive, send))
    assert sent[0]["status"] == 413
    assert pulled == LIMIT // 300 + 1  # stopped at the first piece past the limit


def test_chunked_body_over_the_limit_through_http():
    async def go():
        async with client(guarded(api_key=None)) as c:

            async def pieces():
                for _ in range(8):
                    yield b"w" * 512

            return await c.post("/echo", content=pieces())

    assert_openai_error(run(go()), 413)


def test_a_stalled_body_gets_408():
    async def receive():
        await asyncio.sleep(3600)

    sent = []

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [(b"content-length", b"10")]}
    run(BodyLimitMiddleware(app, LIMIT, read_timeout=0.05)(scope, receive, send))
    assert sent[0]["status"] == 408


def test_after_the_body_the_app_still_sees_the_disconnect():
    """Streaming handlers poll receive() for http.disconnect: the replay must hand it through."""
    messages = iter(
        [{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}]
    )

    async def receive():
        return next(messages)

    seen = []

    async def app(scope, receive, send):
        seen.append(await receive())
        seen.append(await receive())

    async def send(message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [(b"content-length", b"2")]}
    run(BodyLimitMiddleware(app, LIMIT)(scope, receive, send))
    assert seen[0]["body"] == b"{}" and seen[1]["type"] == "http.disconnect"


# ---- admission ----
def test_a_closed_gate_answers_503_but_the_probes_still_answer():
    app = guarded(api_key=None)

    async def go():
        app.state.admission.close("the server is shutting down")
        async with client(app) as c:
            return await c.get("/v1/models"), await c.get("/health")

    refused, health = run(go())
    err = assert_openai_error(refused, 503, "service_unavailable")
    assert "shutting down" in err["message"]
    assert health.status_code == 200


def test_requests_beyond_the_concurrency_cap_get_503_and_the_count_returns_to_zero():
    gate = AdmissionGate(max_in_flight=2)
    release = asyncio.Event()

    async def slow_app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def go():
        async with client(AdmissionMiddleware(slow_app, gate)) as c:
            busy = [asyncio.create_task(c.get("/v1/models")) for _ in range(2)]
            while gate.in_flight < 2:
                await asyncio.sleep(0.01)
            over = await c.get("/v1/models")
            probe_task = asyncio.create_task(c.get("/health"))  # exempt: reaches the (slow) app
            await asyncio.sleep(0.05)
            release.set()
            done = await asyncio.gather(*busy, probe_task)
        return over, done

    over, done = run(go())
    err = assert_openai_error(over, 503, "service_unavailable")
    assert err["code"] == "server_overloaded" and over.headers["retry-after"]
    assert [r.status_code for r in done] == [200, 200, 200]
    assert gate.in_flight == 0


# ---- form-labelled JSON and the order ----
def test_form_labelled_json_is_read_as_json():
    async def go():
        async with client(guarded(api_key=None)) as c:
            return await c.post(
                "/echo", content=b"{}", headers={"content-type": "application/x-www-form-urlencoded"}
            )

    assert run(go()).json()["ctype"] == "application/json"


def test_the_key_is_checked_before_the_body_is_read():
    async def go():
        async with client(guarded()) as c:
            return await c.post("/echo", content=b"x" * (LIMIT * 4))

    assert_openai_error(run(go()), 401)


def test_new_flags_have_sane_defaults_and_are_validated():
    args = ServerArgs()
    assert args.max_request_bytes == 8 << 20
    assert args.graceful_shutdown_timeout > 0 and args.max_concurrent_requests >= 1024
    for bad in (
        {"max_request_bytes": 0},
        {"graceful_shutdown_timeout": -1},
        {"max_concurrent_requests": 0},
    ):
        with pytest.raises(ValueError):
            ServerArgs(**bad)
