"""`/tokenize`, `/detokenize` (also under `/v1/`) and OpenAI's retrieve-model route, on the shared real server.

The token ids `/tokenize` answers are the ones the generation routes prefill: their count equals the
`usage.prompt_tokens` that `/v1/chat/completions` (with and without tools) and `/v1/completions` report for
the same input, measured here with the real `openai` client. Every malformed body is a 400 naming its
field; an unknown model is OpenAI's 404.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from srt.http_server.input_processor import MAX_CHARS_PER_TOKEN

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


# ---- size limits: a request's texts together, /detokenize's ids and its text ----


@pytest.fixture(scope="module")
def limits(api) -> tuple[int, int]:
    """(the server's context length, the most characters all of a request's texts may have together)."""
    context_len = post(api[1], "/tokenize", {"prompt": "x"})["max_model_len"]
    return context_len, context_len * MAX_CHARS_PER_TOKEN


def words(chars: int) -> str:
    return ("lorem ipsum dolor " * (chars // 18 + 1))[:chars]


# (what, the texts' lengths as a function of the limit, status): each text alone is within the limit
BATCH_SIZES = [
    ("one text at the limit", lambda limit: [limit], 200),
    ("two halves at the limit", lambda limit: [limit // 2, limit - limit // 2], 200),
    ("two halves one past it", lambda limit: [limit // 2, limit - limit // 2 + 1], 400),
    ("64 texts, together one past", lambda limit: [limit // 64] * 63 + [limit - 63 * (limit // 64) + 1], 400),
    ("31 texts each just under it (8 MB)", lambda limit: [limit - 544] * 31, 400),
]


@pytest.mark.parametrize("lengths,status", [c[1:] for c in BATCH_SIZES], ids=[c[0] for c in BATCH_SIZES])
@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
def test_all_texts_of_a_batch_together_are_within_the_text_limit(api, limits, path, lengths, status):
    _, http = api
    texts = [words(n) for n in lengths(limits[1])]
    assert all(len(t) <= limits[1] for t in texts)
    r = http.post(path, json={"prompt": texts})
    assert r.status_code == status, r.text[:300]
    if status == 400:
        assert r.json()["error"]["param"] == "prompt" and str(limits[1]) in r.json()["error"]["message"]
    else:
        assert len(r.json()["tokens"]) == len(r.json()["count"]) == len(texts)


@pytest.fixture(scope="module")
def long_token(api) -> tuple[int, int]:
    """(id, characters) of the longest token of an 80-character run of '#' (one token in SmolLM2's vocabulary,
    so few ids make a long text)."""
    _, http = api
    answer = post(http, "/tokenize", {"prompt": "#" * 80, "return_token_strs": True})
    token = max(answer["tokens"], key=lambda t: len(post(http, "/detokenize", {"tokens": [t]})["text"]))
    return token, len(post(http, "/detokenize", {"tokens": [token]})["text"])


# (what, the ids as a function of (context length, text limit, long token id, its characters), status)
DETOKENIZE_SIZES = [
    ("the context's length of ids", lambda ctx, limit, tok, n: [1] * ctx, 200),
    ("one id more", lambda ctx, limit, tok, n: [1] * (ctx + 1), 400),
    ("4,000,000 ids (8 MB)", lambda ctx, limit, tok, n: [1] * 4_000_000, 400),
    ("a long token up to the text limit", lambda ctx, limit, tok, n: [tok] * (limit // n), 200),
    ("a long token one past the text limit", lambda ctx, limit, tok, n: [tok] * (limit // n + 1), 400),
]


@pytest.mark.parametrize(
    "ids,status", [c[1:] for c in DETOKENIZE_SIZES], ids=[c[0] for c in DETOKENIZE_SIZES]
)
def test_detokenize_takes_at_most_the_context_of_ids_and_answers_at_most_the_text_limit(
    api, limits, long_token, ids, status
):
    """Within both caps what /detokenize answers can be sent back to /tokenize; past either it is a 400,
    so an 8 MB body can no longer be answered with ~100 MB."""
    _, http = api
    context_len, limit = limits
    tokens = ids(context_len, limit, *long_token)
    assert len(tokens) > context_len or len(tokens) * long_token[1] > limit or status == 200
    r = http.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == status, r.text[:300]
    if status == 400:
        assert r.json()["error"]["param"] == "tokens"
    else:
        assert len(r.json()["text"]) <= limit
        assert http.post("/tokenize", json={"prompt": r.json()["text"]}).status_code == 200


# ---- tool results must answer an earlier call ----


def tool_call(call_id: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


def calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [tool_call(i) for i in ids]}


def result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 18}'}


USER = {"role": "user", "content": "Weather in Paris and Rome?"}
TOOL_HISTORIES = [
    ("answers the call", [USER, calls("call_1"), result("call_1")], 200),
    ("answers both calls", [USER, calls("call_1", "call_2"), result("call_2"), result("call_1")], 200),
    (
        "a second turn's call",
        [
            USER,
            calls("a"),
            result("a"),
            {"role": "assistant", "content": "18"},
            USER,
            calls("b"),
            result("b"),
        ],
        200,
    ),
    ("no call was made", [USER, result("call_1")], 400),
    ("another call's id", [USER, calls("call_1"), result("call_2")], 400),
    ("the call comes after its result", [USER, result("call_1"), calls("call_1")], 400),
    ("the id differs in case", [USER, calls("call_A"), result("call_a")], 400),
]


@pytest.mark.parametrize(
    "messages,status", [c[1:] for c in TOOL_HISTORIES], ids=[c[0] for c in TOOL_HISTORIES]
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_tool_result_must_answer_an_earlier_assistant_call(api, path, messages, status):
    """OpenAI's rule (it answers 400 too): a tool message's `tool_call_id` is the id of a call an earlier
    assistant message made."""
    _, http = api
    body = {"messages": messages, "tools": TOOLS}
    if path == "/v1/chat/completions":
        body |= {"model": MODEL, "max_tokens": 1}
    r = http.post(path, json=body)
    assert r.status_code == status, r.text[:300]
    if status == 400:
        assert r.json()["error"]["param"] == "messages" and "tool_call_id" in r.json()["error"]["message"]


# ---- the largest allowed requests leave the server responsive ----


def test_health_answers_while_the_largest_allowed_tokenize_and_detokenize_run(api, limits, long_token):
    """The largest answers the limits allow (a batch of texts together at the limit that tokenize to ~3 ids
    a character, with token strings; a context's length of long tokens) are built off the event loop."""
    _, http = api
    context_len, limit = limits
    emoji = "😀🙈"  # each a character, several byte-level tokens
    texts = [(emoji * limit)[: limit // 4]] * 4
    detokenize_ids = [long_token[0]] * (limit // long_token[1])
    assert len(detokenize_ids) <= context_len
    latencies: list[float] = []
    done = threading.Event()

    def poll():
        with httpx.Client(base_url=http.base_url, timeout=30) as probe:
            while not done.is_set():
                start = time.monotonic()
                assert probe.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.02)

    def run(path: str, body: dict) -> httpx.Response:
        with httpx.Client(base_url=http.base_url, headers=http.headers, timeout=120) as client:
            return client.post(path, json=body)

    with ThreadPoolExecutor(3) as pool:
        poller = pool.submit(poll)
        time.sleep(0.1)
        big = pool.submit(run, "/tokenize", {"prompt": texts, "return_token_strs": True})
        long = pool.submit(run, "/detokenize", {"tokens": detokenize_ids})
        big_r, long_r = big.result(), long.result()
        done.set()
        poller.result()
    assert big_r.status_code == 200 and long_r.status_code == 200
    counts = big_r.json()["count"]
    assert sum(counts) > 2 * limit and len(big_r.json()["token_strs"][0]) == counts[0]
    print(
        f"/tokenize answered {sum(counts)} ids ({len(big_r.content) / 1e6:.1f} MB); /health: {len(latencies)} "
        f"probes, slowest {max(latencies) * 1000:.0f} ms"
    )
    assert max(latencies) < 1.0
