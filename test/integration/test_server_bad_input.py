"""Bad input gets OpenAI's error object with a 4xx status and a message naming the problem; the server
keeps serving."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]
# Longer than the embedded model's 8192-token context.
TOO_LONG = "hello " * 9000

CASES = [
    # (id, path, body (dict, or raw bytes), status, param the error must name (None: not checked))
    ("malformed-json", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("body-not-object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("messages-not-list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "bad-role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (
        "mistyped-max-tokens",
        "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": "lots"},
        400,
        "max_tokens",
    ),
    ("negative-max-tokens", "/v1/chat/completions", {"messages": MSGS, "max_tokens": -5}, 400, "max_tokens"),
    ("huge-max-tokens", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 10**9}, 400, "max_tokens"),
    (
        "negative-temperature",
        "/v1/chat/completions",
        {"messages": MSGS, "temperature": -0.5},
        400,
        "temperature",
    ),
    ("top-p-zero", "/v1/chat/completions", {"messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n-zero", "/v1/chat/completions", {"messages": MSGS, "n": 0}, 400, "n"),
    ("unknown-model", "/v1/chat/completions", {"model": "gpt-9", "messages": MSGS}, 404, "model"),
    ("prompt-too-long", "/v1/completions", {"prompt": TOO_LONG, "max_tokens": 1}, 400, "prompt"),
    (
        "chat-too-long",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": TOO_LONG}]},
        400,
        None,
    ),
    ("missing-prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("bad-token-id", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("generate-no-input", "/generate", {"sampling_params": {}}, 400, None),
    (
        "generate-unknown-param",
        "/generate",
        {"text": "x", "sampling_params": {"warp": 9}},
        400,
        "sampling_params.warp",
    ),
    ("generate-unknown-key", "/generate", {"text": "x", "bogus": 1}, 400, "bogus"),
    (
        "generate-has-no-prediction",
        "/generate",
        {"text": "x", "prediction": {"type": "content"}},
        400,
        "prediction",
    ),
    (
        "content-part-unknown-key",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]}]},
        400,
        "messages.0.content.0.bogus",
    ),
    (
        "generate-mistyped-param",
        "/generate",
        {"text": "x", "sampling_params": {"temperature": "hot"}},
        400,
        "sampling_params.temperature",
    ),
    (
        "generate-negative-tokens",
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": -1}},
        400,
        "sampling_params.max_new_tokens",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_gets_an_openai_error(default_server, path, body, status, param):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    headers = {**kw.pop("headers", {}), **default_server.headers}
    r = httpx.post(default_server.base_url + path, headers=headers, timeout=60, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if status == 404:
        assert error["code"] == "model_not_found"


def test_unknown_route_is_an_openai_404(default_server):
    r = httpx.get(default_server.base_url + "/v1/nothing-here", headers=default_server.headers)
    assert r.status_code == 404 and "error" in r.json()


def test_server_still_serves_after_bad_input(default_server):
    assert httpx.get(default_server.base_url + "/health").status_code == 200
    r = httpx.post(
        default_server.base_url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 2},
        headers=default_server.headers,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
