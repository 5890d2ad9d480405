"""Property-based: whatever JSON a client sends to a generation route (or to the tokenizer routes, the LoRA
admin routes, the scale-out routes), and whatever query string, the answer is a 2xx or a 4xx with OpenAI's
error object, never a 5xx, and the server's processes survive. Predictions (OpenAI's Predicted Outputs)
are drawn well-formed, malformed and arbitrary.

Arbitrary JSON values (huge integers, NaN, lone surrogates, nested containers) replace random fields of an
otherwise valid body. Valid bodies are kept cheap: a token budget that is a valid integer is cut to
`MAX_FUZZ_TOKENS`, so the run takes seconds per hundred examples. Examples are derandomized and no
example database is kept, so every CI run sends the same requests.
"""

from __future__ import annotations

import json
import math
import re
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from test.integration.conftest import ServerHandle

pytestmark = pytest.mark.slow

MAX_FUZZ_TOKENS = 4
HTTP_TIMEOUT_SECONDS = 60.0
# 50 examples a route (the generation routes and the tokenizer routes).
FUZZ = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---- arbitrary JSON ----
EDGE_INTS = [0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 2**70, -(10**30)]
# Text with the awkward characters mixed in: lone surrogates (sent as \\ud800 escapes), NUL, non-ASCII.
AWKWARD_CHARS = ["\ud800", "\udfff", "\x00", "é", "😀", "a", " ", "\n"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(EDGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.text(alphabet=st.sampled_from(AWKWARD_CHARS), max_size=6),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=8), children, max_size=4),
    ),
    max_leaves=12,
)

# Fields each route knows (valid names get wrong values more often than random names would).
SAMPLING_FIELDS = [
    "n", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
]  # fmt: skip
CHAT_FIELDS = [
    *SAMPLING_FIELDS, "messages", "model", "max_tokens", "max_completion_tokens", "logprobs",
    "top_logprobs", "stream", "stream_options", "user", "min_tokens", "rid", "prediction",
]  # fmt: skip
COMPLETION_FIELDS = [
    *SAMPLING_FIELDS, "prompt", "model", "max_tokens", "logprobs", "echo", "stream", "stream_options",
    "user", "min_tokens", "rid", "prediction",
]  # fmt: skip
GENERATE_FIELDS = [
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "return_logprob",
    "top_logprobs_num",
]
GENERATE_SAMPLING_FIELDS = [*SAMPLING_FIELDS, "max_new_tokens", "min_new_tokens"]
TOKENIZE_FIELDS = [
    "prompt", "messages", "model", "tools", "tool_choice", "add_special_tokens", "add_generation_prompt",
    "return_token_strs",
]  # fmt: skip


def overrides(fields: list[str]) -> st.SearchStrategy[dict]:
    """Up to three fields, mostly known ones, set to arbitrary JSON."""
    key = st.one_of(st.sampled_from(fields), st.sampled_from(fields), st.text(max_size=8))
    return st.dictionaries(key, json_values, min_size=1, max_size=3)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def cap_tokens(body: dict, *keys: str) -> None:
    """Keep a valid example fast: a token budget that is a large valid number, or absent (null), is cut."""
    for key in keys:
        value = body.get(key)
        if value is None or (is_int(value) and value > MAX_FUZZ_TOKENS):
            body[key] = MAX_FUZZ_TOKENS
        elif isinstance(value, float) and math.isfinite(value) and value > MAX_FUZZ_TOKENS:
            body[key] = float(MAX_FUZZ_TOKENS)


@st.composite
def chat_bodies(draw) -> dict:
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": MAX_FUZZ_TOKENS}
    body.update(draw(overrides(CHAT_FIELDS)))
    cap_tokens(body, "max_tokens")
    if "max_completion_tokens" in body:
        cap_tokens(body, "max_completion_tokens")
    return body


@st.composite
def completion_bodies(draw) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": MAX_FUZZ_TOKENS}
    body.update(draw(overrides(COMPLETION_FIELDS)))
    cap_tokens(body, "max_tokens")
    return body


@st.composite
def generate_bodies(draw) -> dict:
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": MAX_FUZZ_TOKENS}}
    if draw(st.booleans()):
        body["sampling_params"] = {**body["sampling_params"], **draw(overrides(GENERATE_SAMPLING_FIELDS))}
    else:
        body.update(draw(overrides(GENERATE_FIELDS)))
    if isinstance(body.get("sampling_params"), dict):
        body["sampling_params"] = dict(body["sampling_params"])
        cap_tokens(body["sampling_params"], "max_new_tokens")
    return body


@st.composite
def tokenize_bodies(draw) -> dict:
    body = draw(
        st.sampled_from([{"prompt": "Once upon a time"}, {"messages": [{"role": "user", "content": "Hi"}]}])
    )
    # every valid combination of the flags is likely, not only what an override happens to draw
    flags = ("add_special_tokens", "add_generation_prompt", "return_token_strs")
    body |= {flag: draw(st.sampled_from([True, False, None])) for flag in flags}
    return {**body, **draw(st.one_of(st.just({}), overrides(TOKENIZE_FIELDS)))}  # half are valid bodies


@st.composite
def detokenize_bodies(draw) -> dict:
    return {"tokens": [1, 2, 3], **draw(overrides(["tokens", "model"]))}


def anything_or(bodies: st.SearchStrategy[dict]) -> st.SearchStrategy:
    """Mostly mutated valid bodies, sometimes a whole body of arbitrary JSON."""
    return st.one_of(bodies, bodies, bodies, json_values)


# ---- server ----
@pytest.fixture(scope="module")
def server(short_grammar_budget_server):
    return short_grammar_budget_server  # a short compile budget: hostile constraints are refused within it


@pytest.fixture(scope="module")
def client(server: ServerHandle):
    with server.http_client(HTTP_TIMEOUT_SECONDS) as c:
        yield c


def check_answer(client: httpx.Client, path: str, body, method: str = "POST", params=None) -> None:
    # ensure_ascii: lone surrogates go as \ud800 escapes; NaN/Infinity go as their (non-JSON) literals.
    content = None if body is None else json.dumps(body, ensure_ascii=True).encode()
    try:
        r = client.request(
            method, path, content=content, params=params, headers={"content-type": "application/json"}
        )
    except httpx.HTTPError as e:
        pytest.fail(f"no answer ({e!r}) to {method} {path} {params!r} {(content or b'')[:500]!r}")
    event(f"HTTP {r.status_code}")  # the mix of answers, in --hypothesis-show-statistics
    assert r.status_code < 500, (
        f"HTTP {r.status_code} for {method} {path} {params!r} {(content or b'')[:500]!r}: {r.text[:500]}"
    )
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, r.status_code
    if r.status_code >= 400:
        payload = r.json()
        error = payload.get("error") if isinstance(payload, dict) else None
        assert isinstance(error, dict), f"not an OpenAI error object: {r.text[:500]}"
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
        assert isinstance(error["type"], str) and error["type"], error


ROUTE_BODIES = {
    "/v1/chat/completions": chat_bodies(),
    "/v1/completions": completion_bodies(),
    "/generate": generate_bodies(),
    "/tokenize": tokenize_bodies(),
    "/detokenize": detokenize_bodies(),
}


@pytest.mark.usefixtures("child_pids")
@pytest.mark.parametrize("path", ROUTE_BODIES)
@FUZZ
@given(data=st.data())
def test_route_never_5xx(client, path, data):
    check_answer(client, path, data.draw(anything_or(ROUTE_BODIES[path]), label="body"))


# ---- the newer surfaces: predictions, LoRA admin, /v1/loads queries, the scale-out routes ----
PREDICTION_PARTS = st.one_of(
    st.just({"type": "text", "text": " upon a time"}),
    st.dictionaries(st.sampled_from(["type", "text", "extra"]), json_values, max_size=3),
)
predictions = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("content"),
            "content": st.one_of(st.text(max_size=40), st.lists(PREDICTION_PARTS, max_size=4)),
        }
    ),
    st.dictionaries(st.sampled_from(["type", "content", "extra"]), json_values, max_size=3),
    json_values,
)


@st.composite
def prediction_bodies(draw) -> tuple[str, dict]:
    route = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    head = (
        {"prompt": "Once"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Go"}]}
    )
    return route, {
        **head,
        "max_tokens": MAX_FUZZ_TOKENS,
        "stream": draw(st.booleans()),
        "prediction": draw(predictions),
    }


@pytest.mark.usefixtures("child_pids")
@settings(FUZZ, max_examples=25)  # each generates: the slowest of the new surfaces
@given(case=prediction_bodies())
def test_a_prediction_of_any_shape_never_5xx(client, case):
    check_answer(client, *case)


# This server serves no LoRA: a well-formed body is refused after validation, which garbage must not pass.
LORA_BODIES = {
    "/load_lora_adapter": {"lora_name": "a", "lora_path": "/nowhere", "pinned": False},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/nowhere"},
    "/unload_lora_adapter": {"lora_name": "a"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}


@pytest.mark.usefixtures("child_pids")
@settings(FUZZ, max_examples=30)
@given(route=st.sampled_from(sorted(LORA_BODIES)), data=st.data())
def test_lora_admin_garbage_never_5xx(client, route, data):
    fields = overrides(["lora_name", "lora_path", "pinned"]).map(lambda o: {**LORA_BODIES[route], **o})
    check_answer(client, route, data.draw(anything_or(fields), label="body"))


LOAD_SECTIONS = ["core", "memory", "spec", "lora", "disagg", "queues", "all", "gpu", ""]
query_values = st.one_of(
    st.sampled_from(LOAD_SECTIONS),
    st.lists(st.sampled_from(LOAD_SECTIONS), max_size=4).map(",".join),
    st.text(max_size=10),
)
query_strings = st.lists(
    st.tuples(st.one_of(st.just("include"), st.just("include"), st.text(max_size=6)), query_values),
    max_size=3,
)


@pytest.mark.usefixtures("child_pids")
@settings(FUZZ, max_examples=30)
@given(path=st.sampled_from(["/v1/loads", "/get_loads"]), params=query_strings)
def test_loads_query_strings_never_5xx(client, path, params):
    check_answer(client, path, None, method="GET", params=params)


# (method, route) of the routes a gateway calls besides generation (scale_out.md), with a body for a POST
SCALE_OUT = [
    ("GET", "/v1/models"), ("GET", "/model_info"), ("GET", "/get_model_info"), ("GET", "/server_info"),
    ("GET", "/get_server_info"), ("GET", "/tokenizer_info"), ("GET", "/flush_cache"), ("POST", "/flush_cache"),
    ("POST", "/abort_request"), ("GET", "/set_trace_level"), ("POST", "/set_trace_level"), ("GET", "/v1/models/"),
]  # fmt: skip


@pytest.mark.usefixtures("child_pids")
@settings(FUZZ, max_examples=40)
@given(route=st.sampled_from(SCALE_OUT), params=query_strings, data=st.data())
def test_scale_out_routes_never_5xx(client, route, params, data):
    method, path = route
    if path.endswith("/"):  # a model's card: any name
        path += quote(data.draw(st.text(min_size=1, max_size=12), label="model"), safe="")
    fields = overrides(["rid", "abort_all", "level"]) if path == "/abort_request" else json_values
    body = data.draw(st.one_of(st.none(), fields), label="body") if method == "POST" else None
    check_answer(
        client, path, body, method=method, params=data.draw(st.sampled_from([None, params]), label="query")
    )


# ---- valid values at their extremes: these must be served (200), not merely not 5xx ----
VOCAB_IDS = st.integers(0, 49151)  # SmolLM2's vocabulary
TINY_FLOATS = st.sampled_from([5e-324, 1e-300, 1e-45, 1e-40, 1e-30])


@st.composite
def extreme_sampling(draw) -> dict:
    """Every sampling parameter of /v1/completions, each set (or left out) to a valid value, extremes likely."""
    candidates = {
        "temperature": st.one_of(st.just(0.0), TINY_FLOATS, st.floats(1e-6, 3.0), st.floats(1e30, 1e308)),
        "top_p": st.one_of(TINY_FLOATS, st.floats(1e-6, 1.0), st.just(1.0)),
        "top_k": st.one_of(st.just(-1), st.integers(1, 3), st.integers(1, 2**31 - 1)),
        "min_p": st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0)),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "repetition_penalty": st.one_of(TINY_FLOATS, st.floats(1e-6, 2.0)),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "n": st.integers(1, 3),
        "logit_bias": st.dictionaries(VOCAB_IDS.map(str), st.floats(-100.0, 100.0), max_size=4),
        "min_tokens": st.integers(0, MAX_FUZZ_TOKENS),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "stop_token_ids": st.lists(VOCAB_IDS, max_size=3),
        "logprobs": st.integers(0, 5),
        "echo": st.booleans(),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    }
    chosen = draw(st.lists(st.sampled_from(sorted(candidates)), unique=True, max_size=len(candidates)))
    body = {"prompt": "Once upon a time", "max_tokens": MAX_FUZZ_TOKENS}
    return body | {name: draw(candidates[name]) for name in chosen}


@pytest.mark.usefixtures("child_pids")
@settings(FUZZ, max_examples=150)  # many parameters: more examples to meet their combinations
@given(body=extreme_sampling(), stream=st.booleans())
def test_valid_extreme_sampling_parameters_are_served(client, body, stream):
    content = json.dumps(body | {"stream": stream}).encode()
    r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 200, f"HTTP {r.status_code} for {content!r}: {r.text[:500]}"
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-500:]
    else:
        assert len(r.json()["choices"]) == body.get("n", 1)


# ---- hostile constraints: deep nesting, huge repetition counts, cycles ----
@st.composite
def deep_schema(draw) -> str:
    depth = draw(st.integers(1, 400))
    wrap = draw(st.sampled_from(['{"type":"object","properties":{"a":%s}}', '{"type":"array","items":%s}']))
    text = '{"type":"integer"}'
    for _ in range(depth):
        text = wrap % text
    return text


@st.composite
def ref_cycle_schema(draw) -> str:
    """A chain of `$defs` that refers back to its start, with a way out (a null alternative) or not."""
    n = draw(st.integers(1, 4))
    base_case = draw(st.booleans())
    defs = {}
    for i in range(n):
        step = {
            "type": "object",
            "properties": {"next": {"$ref": f"#/$defs/d{(i + 1) % n}"}},
            "required": ["next"],
        }
        defs[f"d{i}"] = {"anyOf": [step, {"type": "null"}]} if base_case and i == n - 1 else step
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


@st.composite
def huge_repeat_regex(draw) -> str:
    inner, outer = draw(st.integers(1, 2000)), draw(st.integers(1, 2000))
    atom = draw(st.sampled_from(["x", "[ab]", "(a|b)", "\\d"]))
    return f"({atom}{{{inner}}}){{{outer}}}"


@st.composite
def doubling_ebnf(draw) -> str:
    levels = draw(st.integers(1, 24))
    recursive = draw(st.booleans())  # a rule that only refers back to itself, with no way out
    rules = "".join(f"r{i} ::= r{i + 1} r{i + 1}\n" for i in range(levels))
    last = f'r{levels} ::= "a" r{levels}' if recursive else f'r{levels} ::= "a"'
    return f"root ::= r0\n{rules}{last}\n"


HOSTILE = {
    "json_schema": st.one_of(deep_schema(), ref_cycle_schema()),
    "regex": huge_repeat_regex(),
    "ebnf": doubling_ebnf(),
}


@st.composite
def hostile_constraint_bodies(draw) -> tuple[str, dict]:
    kind = draw(st.sampled_from(sorted(HOSTILE)))
    spec = draw(HOSTILE[kind])
    route = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]))
    if route == "/generate":
        return route, {"text": "Data:", "sampling_params": {"max_new_tokens": MAX_FUZZ_TOKENS, kind: spec}}
    if route == "/v1/chat/completions" and kind == "json_schema" and draw(st.booleans()):
        schema = json.loads(spec) if len(spec) < 20_000 else {"type": "object"}
        how = draw(st.sampled_from(["response_format", "tool"]))
        if how == "response_format":
            extra = {
                "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
            }
        else:
            tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
            extra = {"tools": [tool], "tool_choice": "required"}
        return route, {
            "messages": [{"role": "user", "content": "Data?"}],
            "max_tokens": MAX_FUZZ_TOKENS,
            **extra,
        }
    head = (
        {"prompt": "Data:"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "?"}]}
    )
    return route, {**head, "max_tokens": MAX_FUZZ_TOKENS, kind: spec}


@pytest.mark.usefixtures("child_pids")
@settings(FUZZ, max_examples=30)
@given(case=hostile_constraint_bodies())
def test_a_hostile_constraint_is_served_or_refused_never_broken(client, case):
    """A 200 or a 400 naming the field; a 200 that says `stop` holds a complete match of a regex (checked
    with Python's re, which reads these regexes alike) or a JSON document."""
    route, body = case
    r = client.post(route, json=body)
    event(f"HTTP {r.status_code}")
    assert r.status_code in (200, 400), f"HTTP {r.status_code} for {str(body)[:300]}: {r.text[:500]}"
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["param"] in ("json_schema", "regex", "ebnf", "response_format", "tools") or error[
            "param"
        ].startswith("sampling_params."), error
        return
    payload = r.json()
    if route == "/generate":
        text, finish = payload["text"], payload["meta_info"]["finish_reason"]["type"]
    else:
        choice = payload["choices"][0]
        text = choice.get("text", choice.get("message", {}).get("content"))
        finish = choice["finish_reason"]
    if finish == "stop" and text is not None:
        if "regex" in body or "regex" in body.get("sampling_params", {}):
            pattern = body.get("regex") or body["sampling_params"]["regex"]
            assert re.fullmatch(pattern, text), (pattern, text)
        elif "json_schema" in body or "response_format" in body:
            json.loads(text)


def test_the_server_survived_the_fuzzing(server, client, child_pids):
    """Runs last: the same children, the launcher alive, /health 200 and a normal request served."""
    assert server.proc.poll() is None, f"the launcher exited with {server.proc.returncode}"
    assert server.child_pids() == child_pids
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
