"""The HTTP layer without a model: request validation, OpenAI response/chunk shapes and error objects,
served by the real FastAPI app around a TokenizerManager whose generation is scripted."""

from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from srt.http_server.app import create_app
from srt.http_server.openai.protocol import ChatCompletionRequest, CompletionRequest
from srt.http_server.output_dispatch import ReqOutput
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.io_struct import FinishReason, SchedulerReady
from srt.port_args import PortArgs
from srt.server_args import ServerArgs

SCRIPT = ["Hello", " world", "!"]  # text deltas every scripted request produces
CONTEXT = 2048


class ScriptedTokenizerManager(TokenizerManager):
    """Real tokenization and validation; generation replays SCRIPT instead of asking a scheduler."""

    def generate(self, obj, request=None):
        return self._script(obj, self.check(obj))

    async def _script(self, obj, per_prompt):
        for p, ids in enumerate(obj.prompts):
            for j in range(obj.n):
                index = p * obj.n + j
                done = 0
                for k, text in enumerate(SCRIPT):
                    new = self.tokenizer(text, add_special_tokens=False).input_ids
                    done += len(new)
                    last = k == len(SCRIPT) - 1
                    lp = [-0.5] * len(new) if per_prompt[p].logprobs is not None else None
                    top = [[(t, -0.5)] for t in new] if lp else None
                    yield ReqOutput(
                        index,
                        f"r{index}",
                        text,
                        new,
                        FinishReason("stop", matched=2) if last else None,
                        len(ids),
                        done,
                        3,
                        lp,
                        top,
                    )


@pytest.fixture(scope="module")
def make_client(embedded_model_dir):
    clients, ipc_dirs = [], []

    def make(**server_kw) -> TestClient:
        args = ServerArgs(disable_metrics=True, **server_kw)
        ports = PortArgs.create()
        ipc_dirs.append(ports.ipc_dir)
        tm = ScriptedTokenizerManager(args, ports, embedded_model_dir)
        tm.set_ready(SchedulerReady(4096, CONTEXT - 1, CONTEXT, 8, "torch_native"))
        client = TestClient(create_app(tm, args))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)
    for d in ipc_dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def client(make_client):
    return make_client()


MSGS = [{"role": "user", "content": "hi"}]


def events(response) -> list:
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


# ---- request models ----


def test_chat_request_maps_to_sampling_params():
    req = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        max_tokens=5,
        max_completion_tokens=7,
        temperature=0,
        stop="END",
        logprobs=True,
        top_logprobs=3,
        ignore_eos=True,
        min_tokens=2,
    )
    params = req.to_sampling_params(req.max_new_tokens(), req.num_top_logprobs())
    assert req.messages[0].text() == "ab"
    assert params.max_new_tokens == 7  # max_completion_tokens wins
    assert params.temperature == 0 and params.is_greedy
    assert params.stop == ["END"] and params.ignore_eos and params.min_new_tokens == 2
    assert params.logprobs == 3


def test_chat_logprobs_false_means_none():
    req = ChatCompletionRequest(messages=MSGS, logprobs=False)
    assert req.num_top_logprobs() is None


def test_chat_top_logprobs_without_logprobs_is_refused():
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatCompletionRequest(messages=MSGS, top_logprobs=4)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("x", ["x"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


# ---- responses ----


def test_chat_response_shape(client):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "model": "SmolLM2-135M-Instruct"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello world!"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    usage = body["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 3}


def test_chat_stream_chunks(client):
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MSGS, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert "".join(content) == "Hello world!"
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_chat_stream_without_usage_has_no_usage_key(client):
    chunks = events(client.post("/v1/chat/completions", json={"messages": MSGS, "stream": True}))
    assert all("usage" not in c for c in chunks)


def test_n_expands_into_indexed_choices_with_prompt_counted_once(client):
    one = client.post("/v1/chat/completions", json={"messages": MSGS}).json()
    two = client.post("/v1/chat/completions", json={"messages": MSGS, "n": 2}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert two["usage"]["completion_tokens"] == 2 * one["usage"]["completion_tokens"]


def test_completion_echo_and_logprobs(client):
    body = client.post("/v1/completions", json={"prompt": "Say:", "echo": True, "logprobs": 1}).json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion"
    assert choice["text"] == "Say:Hello world!"
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == "Hello world!"
    assert lp["text_offset"][0] == len("Say:")
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])


def test_chat_logprobs_shape(client):
    body = client.post(
        "/v1/chat/completions", json={"messages": MSGS, "logprobs": True, "top_logprobs": 1}
    ).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == "Hello world!"
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_generate_native_shape(client):
    body = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}}).json()
    assert body["text"] == "Hello world!"
    meta = body["meta_info"]
    assert meta["completion_tokens"] == len(body["output_ids"])
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert meta["cached_tokens"] == 3 and meta["e2e_latency"] >= 0


def test_models_route(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == "SmolLM2-135M-Instruct"


# ---- errors ----


def test_form_encoded_curl_body_is_read_as_json(client):
    r = client.post(
        "/v1/completions",
        content=b'{"prompt": "x"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": MSGS, "n": 0}, "n"),
        ({"messages": MSGS, "top_p": 0}, "top_p"),
        ({"messages": MSGS, "temperature": -1}, "temperature"),
        ({"messages": MSGS, "max_tokens": CONTEXT}, "max_tokens"),
    ],
)
def test_bad_chat_bodies_are_400_with_the_param(client, body, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    r = client.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_api_key_guard_spares_health_and_metrics(make_client):
    guarded = make_client(api_key="k")
    assert guarded.get("/health").status_code == 200
    assert guarded.get("/metrics").status_code == 404  # metrics disabled here, but not 401
    assert guarded.get("/v1/models").status_code == 401
    assert guarded.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


def test_metrics_is_404_when_disabled(client):
    assert client.get("/metrics").status_code == 404


def test_health_turns_503_when_a_child_died(make_client):
    c = make_client()
    c.app.state.tokenizer_manager.fail_all("scheduler process died")
    assert c.get("/health").status_code == 503
    r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "died" in r.json()["error"]["message"]
