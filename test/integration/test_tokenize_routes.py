"""`/tokenize`, `/detokenize` (also under `/v1/`) and OpenAI's retrieve-model route, on the shared real server.

The token ids `/tokenize` answers are the ones the generation routes prefill: their count equals the
`usage.prompt_tokens` that `/v1/chat/completions` (with and without tools) and `/v1/completions` report for
the same input, measured here with the real `openai` client. Every malformed body is a 400 naming its
field; an unknown model is OpenAI's 404.
"""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Which colour is the sky on a clear day?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TEXT = "The quick brown fox jumps over the lazy dog, naïvely — 3.14 times."


@pytest.fixture(scope="module")
def api(default_server):
    client = openai.OpenAI(base_url=default_server.openai_base_url, api_key=default_server.api_key)
    http = httpx.Client(base_url=default_server.base_url, headers=default_server.headers, timeout=60)
    yield client, http
    http.close()


def post(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "with-tools"])
def test_tokenize_counts_what_chat_completions_prefills(api, tools):
    client, http = api
    body = {"messages": CHAT} | ({"tools": TOOLS} if tools else {})
    answer = post(http, "/tokenize", body)
    extra = {"tools": tools} if tools else {}
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, **extra)
    assert answer["count"] == len(answer["tokens"]) == reply.usage.prompt_tokens
    assert answer["max_model_len"] == client.models.retrieve(MODEL).model_extra["max_model_len"]
    # tools change the prompt (their descriptions are written into it)
    if tools:
        assert answer["count"] > post(http, "/tokenize", {"messages": CHAT})["count"]


def test_tokenize_without_the_generation_prompt_is_a_prefix_of_it(api):
    _, http = api
    full = post(http, "/tokenize", {"messages": CHAT})["tokens"]
    bare = post(http, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})["tokens"]
    assert len(bare) < len(full) and full[: len(bare)] == bare


def test_tokenize_a_prompt_as_completions_does_and_detokenize_returns_the_text(api):
    client, http = api
    answer = post(http, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    reply = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1)
    assert answer["count"] == reply.usage.prompt_tokens
    assert len(answer["token_strs"]) == answer["count"] and all(answer["token_strs"])
    back = post(http, "/detokenize", {"tokens": answer["tokens"]})
    assert back["prompt"] == back["text"] == TEXT
    # completions also takes the ids: the same prompt, the same count
    by_ids = client.completions.create(model=MODEL, prompt=answer["tokens"], max_tokens=1)
    assert by_ids.usage.prompt_tokens == answer["count"]


def test_a_list_of_texts_is_answered_field_by_field_and_v1_routes_are_the_same(api):
    _, http = api
    texts = [TEXT, "hello", "a b c"]
    batch = post(http, "/v1/tokenize", {"prompt": texts})
    singles = [post(http, "/tokenize", {"prompt": t}) for t in texts]
    assert batch["tokens"] == [s["tokens"] for s in singles]
    assert batch["count"] == [s["count"] for s in singles]
    assert batch["max_model_len"] == singles[0]["max_model_len"]
    assert post(http, "/v1/detokenize", {"tokens": singles[1]["tokens"]})["text"] == "hello"


@pytest.mark.parametrize("special", [True, False, None])
@pytest.mark.parametrize("form", ["prompt", "messages"])
def test_add_special_tokens_is_honoured_for_both_forms(api, form, special):
    """SmolLM2's tokenizer adds no BOS of its own, so the ids are the same either way; what matters is that
    every combination is answered (one of them was a 500)."""
    _, http = api
    body = {"prompt": TEXT} if form == "prompt" else {"messages": CHAT}
    default = post(http, "/tokenize", body)
    assert post(http, "/tokenize", body | {"add_special_tokens": special})["tokens"] == default["tokens"]


BAD_BODIES = [
    ({}, "prompt"),
    ({"prompt": "x", "messages": CHAT}, "prompt"),
    ({"prompt": [1, 2]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "tools": TOOLS}, "tools"),
    ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"prompt": "x", "unknown_field": 1}, "unknown_field"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"prompt": "x" * 300_000}, "prompt"),  # past what the 8192-token context could hold (32 chars a token)
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_malformed_tokenize_bodies_are_400s_naming_the_field(api, body, param):
    _, http = api
    r = http.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


@pytest.mark.parametrize(
    "tokens,status", [([1, 49152], 400), ([-1], 400), ([True], 400), (["1"], 400), ("1 2", 400)]
)
def test_detokenize_refuses_ids_outside_the_vocabulary_and_non_integers(api, tokens, status):
    _, http = api
    r = http.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == status and r.json()["error"]["param"].startswith("tokens"), r.text


def test_an_unknown_model_is_a_404_on_every_route_and_the_key_is_required(api, default_server):
    client, http = api
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = http.post(path, json=body | {"model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert httpx.post(f"{default_server.base_url}{path}", json=body).status_code == 401
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other-model")
    assert http.get("/v1/models/").status_code == 404  # no name is not the served name here
