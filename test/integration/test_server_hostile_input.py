"""The HTTP boundary: whatever a hostile client sends to any route, it gets a 4xx with OpenAI's
error object naming the field at fault, and the very same server processes keep serving afterwards.

One server serves the whole module. Its baseline (child pids, the start-time lines of /metrics) is recorded
before the first case; the last test checks that nothing restarted. Duplicate rids and explicit aborts,
which need requests in flight, are specified here too.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
import uuid

import httpx
import pytest

from test.integration.conftest import API_KEY, ServerHandle, running_server

pytestmark = pytest.mark.slow

# A small --max-request-bytes so a 2 MB body is over it (the default is larger).
MAX_REQUEST_BYTES = 1_000_000
OVERSIZED_BODY_CHARS = 2_000_000
# The embedded SmolLM2's vocabulary: valid token ids are [0, VOCAB_SIZE).
VOCAB_SIZE = 49152
HTTP_TIMEOUT_SECONDS = 60.0
# Long enough to still be decoding while the test sends its other requests.
LONG_TOKENS = 128
VERY_LONG_TOKENS = 2000
STREAM_START_TIMEOUT_SECONDS = 60.0
STREAM_END_TIMEOUT_SECONDS = 120.0
# A duplicate rid that slips through leaves its client hanging: give up well before the stream ends.
DUPLICATE_RID_TIMEOUT_SECONDS = 20.0

MSGS = [{"role": "user", "content": "hi"}]
SURROGATE = "\ud800"  # a lone UTF-16 surrogate: json.dumps(ensure_ascii=True) sends it as the escape \ud800
ERROR_KEYS = {"message", "type", "param", "code"}


def chat(**fields) -> dict:
    return {"messages": MSGS, "max_tokens": 2, **fields}


def cmpl(**fields) -> dict:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def gen(**sampling) -> dict:
    """A /generate body whose sampling_params are overridden by `sampling`."""
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2, **sampling}}


def gen_top(**fields) -> dict:
    """A /generate body whose top-level fields are overridden by `fields`."""
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2}, **fields}


def raw(text: str) -> bytes:
    """A body sent byte for byte (NaN literals, truncated JSON, non-objects)."""
    return text.encode()


def case(case_id, path, body, param, status=400, method="POST", limit_below=None):
    """One table row. `param`: the field the error must name (a str, a tuple of acceptable names, or None
    when no single field is at fault); `status`: an int or a tuple of acceptable ones; `limit_below`: the
    message must state a limit, i.e. contain a number smaller than this (the size that was sent)."""
    return pytest.param(method, path, body, status, param, limit_below, id=case_id)


CHAT, CMPL, GEN, ABORT, FLUSH = (
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/abort_request",
    "/flush_cache",
)
OOV = VOCAB_SIZE  # the first id past the vocabulary
HUGE_ID = 2**70
BIG = "a" * OVERSIZED_BODY_CHARS

CASES = [
    # ---- malformed bodies, every generation route ----
    case("chat-truncated-json", CHAT, raw('{"messages": ['), None),
    case("cmpl-truncated-json", CMPL, raw('{"prompt": "x", '), None),
    case("gen-truncated-json", GEN, raw('{"text": "x"'), None),
    case("chat-body-array", CHAT, raw("[1, 2]"), None),
    case("cmpl-body-string", CMPL, raw('"hello"'), None),
    case("gen-body-null", GEN, raw("null"), None),
    case("gen-body-number", GEN, raw("7"), None),
    case("chat-invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    case("cmpl-invalid-utf8", CMPL, b'{"prompt": "\xff\xfe"}', None),
    case("gen-invalid-utf8", GEN, b'{"text": "\xc3\x28"}', None),
    # ---- NaN / Infinity literals (Python's json accepts them; a request must not) ----
    case("cmpl-temperature-nan", CMPL, raw('{"prompt": "x", "max_tokens": 2, "temperature": NaN}'), None),
    case(
        "chat-top-p-infinity",
        CHAT,
        raw('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "top_p": Infinity}'),
        None,
    ),
    case(
        "chat-presence-penalty-nan",
        CHAT,
        raw('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "presence_penalty": NaN}'),
        None,
    ),
    case(
        "gen-temperature-neg-infinity",
        GEN,
        raw('{"text": "x", "sampling_params": {"max_new_tokens": 2, "temperature": -Infinity}}'),
        None,
    ),
    case(
        "gen-min-p-nan",
        GEN,
        raw('{"text": "x", "sampling_params": {"max_new_tokens": 2, "min_p": NaN}}'),
        None,
    ),
    # ---- chat: wrong types ----
    case("chat-messages-null", CHAT, chat(messages=None), "messages"),
    case("chat-messages-object", CHAT, chat(messages={"role": "user", "content": "x"}), "messages"),
    case("chat-message-not-object", CHAT, chat(messages=[5]), "messages"),
    case("chat-role-int", CHAT, chat(messages=[{"role": 5, "content": "x"}]), "messages"),
    case("chat-content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages"),
    case(
        "chat-content-object",
        CHAT,
        chat(messages=[{"role": "user", "content": {"type": "text"}}]),
        "messages",
    ),
    case(
        "chat-content-part-text-int",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        "messages",
    ),
    case("chat-temperature-string", CHAT, chat(temperature="hot"), "temperature"),
    case("chat-temperature-list", CHAT, chat(temperature=[1]), "temperature"),
    case("chat-top-p-object", CHAT, chat(top_p={}), "top_p"),
    case("chat-n-string", CHAT, chat(n="2"), "n"),
    case("chat-max-tokens-string", CHAT, chat(max_tokens="5"), "max_tokens"),
    case("chat-stream-string", CHAT, chat(stream="yes"), "stream"),
    case("chat-logprobs-int", CHAT, chat(logprobs=1), "logprobs"),
    case("chat-stream-options-string", CHAT, chat(stream_options="x"), "stream_options"),
    case("chat-stop-int", CHAT, chat(stop=7), "stop"),
    case("chat-stop-object", CHAT, chat(stop={"a": 1}), "stop"),
    case("chat-stop-list-of-ints", CHAT, chat(stop=[1, 2]), "stop"),
    case("chat-seed-string", CHAT, chat(seed="abc"), "seed"),
    case("chat-model-int", CHAT, chat(model=5), "model"),
    case("chat-rid-int", CHAT, chat(rid=5), "rid"),
    case("chat-stop-token-ids-string", CHAT, chat(stop_token_ids="x"), "stop_token_ids"),
    # ---- chat: bools and floats for ints ----
    case("chat-n-true", CHAT, chat(n=True), "n"),
    case("chat-max-tokens-true", CHAT, chat(max_tokens=True), "max_tokens"),
    case("chat-seed-false", CHAT, chat(seed=False), "seed"),
    case("chat-top-logprobs-true", CHAT, chat(logprobs=True, top_logprobs=True), "top_logprobs"),
    case("chat-n-float", CHAT, chat(n=1.5), "n"),
    case("chat-seed-float", CHAT, chat(seed=1.5), "seed"),
    # ---- chat: out of range ----
    case("chat-temperature-negative", CHAT, chat(temperature=-1), "temperature"),
    case("chat-top-p-zero", CHAT, chat(top_p=0), "top_p"),
    case("chat-top-p-above-one", CHAT, chat(top_p=1.5), "top_p"),
    case("chat-top-k-zero", CHAT, chat(top_k=0), "top_k"),
    case("chat-top-k-minus-two", CHAT, chat(top_k=-2), "top_k"),
    case("chat-min-p-two", CHAT, chat(min_p=2), "min_p"),
    case("chat-presence-penalty-three", CHAT, chat(presence_penalty=3), "presence_penalty"),
    case("chat-frequency-penalty-minus-three", CHAT, chat(frequency_penalty=-3), "frequency_penalty"),
    case("chat-repetition-penalty-zero", CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    case("chat-n-zero", CHAT, chat(n=0), "n"),
    case("chat-n-65", CHAT, chat(n=65), "n"),
    case("chat-max-tokens-zero", CHAT, chat(max_tokens=0), "max_tokens"),
    case("chat-max-tokens-minus-one", CHAT, chat(max_tokens=-1), "max_tokens"),
    case("chat-max-tokens-1e9", CHAT, chat(max_tokens=10**9), "max_tokens"),
    case("chat-max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    case("chat-top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    case("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), ("top_logprobs", "logprobs")),
    # ---- chat: 64-bit overflows ----
    case("chat-seed-2-64", CHAT, chat(seed=2**64), "seed"),
    case("chat-seed-below-int64", CHAT, chat(seed=-(2**63) - 1), "seed"),
    case("chat-max-tokens-2-63", CHAT, chat(max_tokens=2**63), "max_tokens"),
    case("chat-stop-token-id-2-63", CHAT, chat(stop_token_ids=[2**63]), "stop_token_ids"),
    # ---- chat: token ids, surrogates, oversized lists ----
    case("chat-stop-token-id-negative", CHAT, chat(stop_token_ids=[-1]), "stop_token_ids"),
    case("chat-stop-token-id-oov", CHAT, chat(stop_token_ids=[OOV]), "stop_token_ids"),
    case(
        "chat-surrogate-content",
        CHAT,
        chat(messages=[{"role": "user", "content": f"a{SURROGATE}b"}]),
        "messages",
    ),
    case(
        "chat-surrogate-content-part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
        "messages",
    ),
    case("chat-surrogate-model", CHAT, chat(model=SURROGATE), "model", status=(400, 404)),
    case("chat-surrogate-stop", CHAT, chat(stop=[SURROGATE]), "stop"),
    case("chat-surrogate-rid", CHAT, chat(rid=SURROGATE), "rid"),
    case(
        "chat-stop-10000-strings",
        CHAT,
        chat(stop=[f"s{i}" for i in range(10_000)]),
        "stop",
        limit_below=10_000,
    ),
    # ---- completions: the prompt ----
    case("cmpl-prompt-int", CMPL, cmpl(prompt=5), "prompt"),
    case("cmpl-prompt-null", CMPL, cmpl(prompt=None), "prompt"),
    case("cmpl-prompt-object", CMPL, cmpl(prompt={"a": 1}), "prompt"),
    case("cmpl-prompt-float-ids", CMPL, cmpl(prompt=[1.5, 2.5]), "prompt"),
    case("cmpl-prompt-bool-ids", CMPL, cmpl(prompt=[True, False]), "prompt"),
    case("cmpl-prompt-mixed-list", CMPL, cmpl(prompt=["a", 1]), "prompt"),
    case("cmpl-prompt-nested-wrong", CMPL, cmpl(prompt=[1, [2]]), "prompt"),
    case("cmpl-prompt-triple-nested", CMPL, cmpl(prompt=[[[1]]]), "prompt"),
    case("cmpl-prompt-empty-inner", CMPL, cmpl(prompt=[[]]), "prompt"),
    case("cmpl-prompt-empty-list", CMPL, cmpl(prompt=[]), "prompt"),
    case("cmpl-prompt-negative-id", CMPL, cmpl(prompt=[1, -1]), "prompt"),
    case("cmpl-prompt-oov-id", CMPL, cmpl(prompt=[1, OOV]), "prompt"),
    case("cmpl-prompt-2-70-id", CMPL, cmpl(prompt=[HUGE_ID]), "prompt"),
    case("cmpl-prompts-negative-id", CMPL, cmpl(prompt=[[1, 2], [-5]]), "prompt"),
    case("cmpl-prompts-oov-id", CMPL, cmpl(prompt=[[1, 2], [10**6]]), "prompt"),
    case("cmpl-prompts-2-70-id", CMPL, cmpl(prompt=[[1], [HUGE_ID]]), "prompt"),
    case("cmpl-1000-prompts", CMPL, cmpl(prompt=["hi"] * 1000, max_tokens=1), "prompt", limit_below=1000),
    case("cmpl-surrogate-prompt", CMPL, cmpl(prompt=f"x{SURROGATE}"), "prompt"),
    case("cmpl-surrogate-echo-prompt", CMPL, cmpl(prompt=SURROGATE, echo=True), "prompt"),
    case("cmpl-surrogate-prompt-in-list", CMPL, cmpl(prompt=["ok", SURROGATE]), "prompt"),
    case("cmpl-surrogate-model", CMPL, cmpl(model=SURROGATE), "model", status=(400, 404)),
    # ---- completions: the other fields ----
    case("cmpl-logprobs-21", CMPL, cmpl(logprobs=21), "logprobs"),
    case("cmpl-logprobs-negative", CMPL, cmpl(logprobs=-1), "logprobs"),
    case("cmpl-logprobs-true", CMPL, cmpl(logprobs=True), "logprobs"),
    case("cmpl-echo-string", CMPL, cmpl(echo="yes"), "echo"),
    case("cmpl-max-tokens-float", CMPL, cmpl(max_tokens=2.0), "max_tokens"),
    case("cmpl-max-tokens-2-63", CMPL, cmpl(max_tokens=2**63), "max_tokens"),
    case("cmpl-seed-2-64", CMPL, cmpl(seed=2**64), "seed"),
    case("cmpl-seed-float", CMPL, cmpl(seed=1.5), "seed"),
    case("cmpl-stop-token-ids-string-ids", CMPL, cmpl(stop_token_ids=["x"]), "stop_token_ids"),
    case("cmpl-stop-token-ids-nested", CMPL, cmpl(stop_token_ids=[[1]]), "stop_token_ids"),
    case("cmpl-stop-token-ids-2-70", CMPL, cmpl(stop_token_ids=[HUGE_ID]), "stop_token_ids"),
    case("cmpl-stop-10000-strings", CMPL, cmpl(stop=["ab"] * 10_000), "stop", limit_below=10_000),
    case(
        "cmpl-stop-token-ids-100000",
        CMPL,
        cmpl(stop_token_ids=[i % VOCAB_SIZE for i in range(100_000)]),
        "stop_token_ids",
        limit_below=100_000,
    ),
    # ---- /generate: text and input_ids ----
    case(
        "gen-text-and-input-ids",
        GEN,
        {"text": "hi", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
        ("text", "input_ids"),
    ),
    case(
        "gen-neither-text-nor-input-ids",
        GEN,
        {"sampling_params": {"max_new_tokens": 2}},
        ("text", "input_ids"),
    ),
    case("gen-text-int", GEN, gen_top(text=5), "text"),
    case("gen-text-list-of-ints", GEN, gen_top(text=[1, 2]), "text"),
    case("gen-text-list-mixed", GEN, gen_top(text=["a", 5]), "text"),
    case("gen-text-empty-list", GEN, gen_top(text=[]), "text"),
    case("gen-text-surrogate", GEN, gen_top(text=SURROGATE), "text"),
    case("gen-text-list-surrogate", GEN, gen_top(text=["fine", f"a{SURROGATE}"]), "text"),
    case(
        "gen-input-ids-string",
        GEN,
        {"input_ids": "abc", "sampling_params": {"max_new_tokens": 2}},
        "input_ids",
    ),
    case(
        "gen-input-ids-negative",
        GEN,
        {"input_ids": [1, -1], "sampling_params": {"max_new_tokens": 2}},
        "input_ids",
    ),
    case(
        "gen-input-ids-oov", GEN, {"input_ids": [OOV], "sampling_params": {"max_new_tokens": 2}}, "input_ids"
    ),
    case(
        "gen-input-ids-2-70",
        GEN,
        {"input_ids": [HUGE_ID], "sampling_params": {"max_new_tokens": 2}},
        "input_ids",
    ),
    case(
        "gen-input-ids-2-64-in-batch",
        GEN,
        {"input_ids": [[1], [2**64]], "sampling_params": {"max_new_tokens": 2}},
        "input_ids",
    ),
    case(
        "gen-input-ids-float",
        GEN,
        {"input_ids": [1.5], "sampling_params": {"max_new_tokens": 2}},
        "input_ids",
    ),
    case(
        "gen-input-ids-bool",
        GEN,
        {"input_ids": [True], "sampling_params": {"max_new_tokens": 2}},
        "input_ids",
    ),
    case(
        "gen-input-ids-nested-wrong",
        GEN,
        {"input_ids": [1, [2]], "sampling_params": {"max_new_tokens": 2}},
        "input_ids",
    ),
    case(
        "gen-input-ids-triple-nested",
        GEN,
        {"input_ids": [[[1]]], "sampling_params": {"max_new_tokens": 2}},
        "input_ids",
    ),
    case(
        "gen-input-ids-empty-inner",
        GEN,
        {"input_ids": [[]], "sampling_params": {"max_new_tokens": 2}},
        "input_ids",
    ),
    case(
        "gen-input-ids-empty", GEN, {"input_ids": [], "sampling_params": {"max_new_tokens": 2}}, "input_ids"
    ),
    # ---- /generate: sampling_params ----
    case("gen-sampling-params-list", GEN, gen_top(sampling_params=[]), "sampling_params"),
    case("gen-sampling-params-string", GEN, gen_top(sampling_params="greedy"), "sampling_params"),
    case("gen-unknown-sampling-param", GEN, gen(warp=9), "sampling_params"),
    case("gen-stop-int", GEN, gen(stop=7), "sampling_params.stop"),
    case("gen-stop-object", GEN, gen(stop={"a": 1}), "sampling_params.stop"),
    case("gen-stop-list-of-ints", GEN, gen(stop=[1]), "sampling_params.stop"),
    case("gen-stop-surrogate", GEN, gen(stop=[SURROGATE]), "sampling_params.stop"),
    case(
        "gen-stop-10000-strings", GEN, gen(stop=["ab"] * 10_000), "sampling_params.stop", limit_below=10_000
    ),
    case(
        "gen-stop-token-ids-strings",
        GEN,
        gen(stop_token_ids=["x"], min_new_tokens=1),
        "sampling_params.stop_token_ids",
    ),
    case(
        "gen-stop-token-ids-2-63",
        GEN,
        gen(stop_token_ids=[2**63], min_new_tokens=1),
        "sampling_params.stop_token_ids",
    ),
    case("gen-stop-token-ids-negative", GEN, gen(stop_token_ids=[-3]), "sampling_params.stop_token_ids"),
    case("gen-stop-token-ids-oov", GEN, gen(stop_token_ids=[10**6]), "sampling_params.stop_token_ids"),
    case("gen-max-new-tokens-string", GEN, gen(max_new_tokens="5"), "sampling_params.max_new_tokens"),
    case("gen-max-new-tokens-true", GEN, gen(max_new_tokens=True), "sampling_params.max_new_tokens"),
    case("gen-max-new-tokens-float", GEN, gen(max_new_tokens=1.5), "sampling_params.max_new_tokens"),
    case("gen-max-new-tokens-negative", GEN, gen(max_new_tokens=-1), "sampling_params.max_new_tokens"),
    case("gen-max-new-tokens-2-63", GEN, gen(max_new_tokens=2**63), "sampling_params.max_new_tokens"),
    case("gen-min-new-tokens-above-max", GEN, gen(min_new_tokens=5), "sampling_params.min_new_tokens"),
    case("gen-n-zero", GEN, gen(n=0), "sampling_params.n"),
    case("gen-n-true", GEN, gen(n=True), "sampling_params.n"),
    case("gen-n-65", GEN, gen(n=65), "sampling_params.n"),
    case("gen-seed-2-64", GEN, gen(seed=2**64), "sampling_params.seed"),
    case("gen-seed-below-int64", GEN, gen(seed=-(2**63) - 1), "sampling_params.seed"),
    case("gen-seed-string", GEN, gen(seed="abc"), "sampling_params.seed"),
    case("gen-seed-float", GEN, gen(seed=1.5), "sampling_params.seed"),
    case("gen-seed-false", GEN, gen(seed=False), "sampling_params.seed"),
    case("gen-temperature-string", GEN, gen(temperature="hot"), "sampling_params.temperature"),
    case("gen-temperature-negative", GEN, gen(temperature=-1), "sampling_params.temperature"),
    case("gen-top-p-zero", GEN, gen(top_p=0), "sampling_params.top_p"),
    case("gen-top-k-zero", GEN, gen(top_k=0), "sampling_params.top_k"),
    case("gen-top-k-float", GEN, gen(top_k=1.5), "sampling_params.top_k"),
    case("gen-min-p-two", GEN, gen(min_p=2), "sampling_params.min_p"),
    case("gen-repetition-penalty-zero", GEN, gen(repetition_penalty=0), "sampling_params.repetition_penalty"),
    case("gen-frequency-penalty-three", GEN, gen(frequency_penalty=3), "sampling_params.frequency_penalty"),
    case("gen-ignore-eos-string", GEN, gen(ignore_eos="no"), "sampling_params.ignore_eos"),
    # ---- /generate: the other top-level fields ----
    case(
        "gen-top-logprobs-num-true",
        GEN,
        gen_top(return_logprob=True, top_logprobs_num=True),
        "top_logprobs_num",
    ),
    case(
        "gen-top-logprobs-num-21", GEN, gen_top(return_logprob=True, top_logprobs_num=21), "top_logprobs_num"
    ),
    case(
        "gen-top-logprobs-num-negative",
        GEN,
        gen_top(return_logprob=True, top_logprobs_num=-1),
        "top_logprobs_num",
    ),
    case("gen-return-logprob-string", GEN, gen_top(return_logprob="yes"), "return_logprob"),
    case("gen-stream-string", GEN, gen_top(stream="yes"), "stream"),
    case("gen-rid-int", GEN, gen_top(rid=5), "rid"),
    case("gen-rid-surrogate", GEN, gen_top(rid=SURROGATE), "rid"),
    # ---- bodies over --max-request-bytes ----
    case("chat-body-over-limit", CHAT, chat(messages=[{"role": "user", "content": BIG}]), None, status=413),
    case("cmpl-body-over-limit", CMPL, cmpl(prompt=BIG), None, status=413),
    case("gen-body-over-limit", GEN, gen_top(text=BIG), None, status=413),
    # ---- /abort_request: a rid or an explicit abort_all, nothing else ----
    case("abort-empty-object", ABORT, {}, ("rid", "abort_all")),
    case("abort-rid-int", ABORT, {"rid": 5}, "rid"),
    case("abort-rid-empty", ABORT, {"rid": ""}, "rid"),
    case("abort-rid-null", ABORT, {"rid": None}, ("rid", "abort_all")),
    case("abort-rid-list", ABORT, {"rid": ["a"]}, "rid"),
    case("abort-rid-surrogate", ABORT, {"rid": SURROGATE}, "rid"),
    case("abort-rid-and-abort-all", ABORT, {"rid": "x", "abort_all": True}, ("rid", "abort_all")),
    case("abort-all-string", ABORT, {"abort_all": "yes"}, "abort_all"),
    case("abort-all-int", ABORT, {"abort_all": 1}, "abort_all"),
    case("abort-all-false", ABORT, {"abort_all": False}, ("rid", "abort_all")),
    case("abort-body-array", ABORT, raw('["x"]'), None),
    case("abort-body-string", ABORT, raw('"x"'), None),
    case("abort-body-not-json", ABORT, raw("rid=x"), None),
    # ---- /flush_cache ----
    case("flush-body-not-json", FLUSH, raw("please flush"), None),
    case("flush-body-array", FLUSH, raw("[1]"), None),
    case("flush-unknown-field", FLUSH, {"everything": True}, "everything"),
    # ---- wrong methods ----
    case("flush-put", FLUSH, None, None, status=405, method="PUT"),
    case("flush-delete", FLUSH, None, None, status=405, method="DELETE"),
    case("abort-get", ABORT, None, None, status=405, method="GET"),
    case("chat-get", CHAT, None, None, status=405, method="GET"),
    case("cmpl-put", CMPL, None, None, status=405, method="PUT"),
    case("gen-get", GEN, None, None, status=405, method="GET"),
]


# ---- server, client and baseline ----
@dataclasses.dataclass
class Baseline:
    child_pids: dict[str, int]
    start_lines: list[str]


# Samples that change when a process starts: prometheus' process start time (if a process exports it) and
# the scheduler's start-up gauges, which a restarted scheduler would overwrite.
START_SAMPLE = re.compile(
    r"^(\S*process_start_time_seconds|sglang:engine_startup_time|sglang:engine_load_weights_time)[{ ]"
)


def start_lines(metrics_text: str) -> list[str]:
    return sorted(line for line in metrics_text.splitlines() if START_SAMPLE.match(line))


@pytest.fixture(scope="module")
def server():
    with running_server("--max-request-bytes", str(MAX_REQUEST_BYTES), api_key=API_KEY) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle):
    with server.http_client(HTTP_TIMEOUT_SECONDS) as c:
        yield c


@pytest.fixture(scope="module")
def baseline(server: ServerHandle, client: httpx.Client) -> Baseline:
    """Recorded once, before the first test of the module that asks for it."""
    pids = server.child_pids()
    assert {"srt-scheduler", "srt-detokenizer"} <= set(pids), pids
    lines = start_lines(client.get("/metrics").text)
    assert lines, "no start-time samples in /metrics to compare"
    return Baseline(pids, lines)


# ---- helpers ----
def send(
    client: httpx.Client, method: str, path: str, body, timeout: float = HTTP_TIMEOUT_SECONDS
) -> httpx.Response:
    """`body`: a dict (serialized with escapes, so lone surrogates travel as \\ud800), raw bytes, or None."""
    if body is None:
        return client.request(method, path, timeout=timeout)
    content = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=True).encode()
    headers = {"content-type": "application/json"}
    return client.request(method, path, content=content, headers=headers, timeout=timeout)


def openai_error(r: httpx.Response) -> dict:
    """The error object of a 4xx reply, asserting OpenAI's shape."""
    try:
        payload = r.json()
    except ValueError:
        pytest.fail(f"HTTP {r.status_code} with a non-JSON body: {r.text[:300]!r}")
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), payload
    error = payload["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error


def names_field(error: dict, fields: str | tuple[str, ...]) -> bool:
    """`param` starts with one of `fields`; or, with no param, the message names one of them."""
    fields = (fields,) if isinstance(fields, str) else fields
    param = error["param"]
    if param:
        return isinstance(param, str) and param.startswith(fields)
    return any(f in error["message"] for f in fields)


def states_a_limit(message: str, sent: int) -> bool:
    return any(int(n) < sent for n in re.findall(r"\d+", message.replace(",", "").replace("_", "")))


# ---- the table ----
@pytest.mark.usefixtures("baseline")
@pytest.mark.parametrize(("method", "path", "body", "status", "param", "limit_below"), CASES)
def test_hostile_input_gets_an_openai_4xx(client, method, path, body, status, param, limit_below):
    r = send(client, method, path, body)
    allowed = (status,) if isinstance(status, int) else status
    assert r.status_code in allowed, f"HTTP {r.status_code}, expected {allowed}: {r.text[:500]}"
    error = openai_error(r)
    if param is not None:
        assert names_field(error, param), f"the error does not name {param!r}: {error}"
    if limit_below is not None:
        assert states_a_limit(error["message"], limit_below), f"no limit in the message: {error}"


# ---- requests in flight: duplicate rids and aborts ----
class GenerateStream(threading.Thread):
    """A streamed /generate request in a thread; `events` are its decoded SSE payloads."""

    def __init__(self, server: ServerHandle, rid: str, max_new_tokens: int):
        super().__init__(daemon=True, name=f"stream-{rid}")
        self.server = server
        self.body = {
            "text": "Tell me a very long story about a lighthouse.",
            "rid": rid,
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        }
        self.events: list[dict] = []
        self.status: int | None = None
        self.error: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST",
                self.server.base_url + "/generate",
                json=self.body,
                headers=self.server.headers,
                timeout=STREAM_END_TIMEOUT_SECONDS,
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.events.append(json.loads(line[len("data: ") :]))
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = repr(e)
        finally:
            self.started.set()

    def wait_started(self) -> None:
        assert self.started.wait(STREAM_START_TIMEOUT_SECONDS), "the stream never started"
        assert self.events, f"the stream ended before its first token: {self.status} {self.error}"

    def finish(self) -> dict:
        """Wait for the end and return the final meta_info."""
        self.join(STREAM_END_TIMEOUT_SECONDS)
        assert not self.is_alive(), f"request {self.body['rid']} hung"
        assert self.error is None and self.status == 200, (self.status, self.error)
        assert self.events and "meta_info" in self.events[-1], self.events[-1:]
        return self.events[-1]["meta_info"]


def start_streams(server: ServerHandle, *specs: tuple[str, int]) -> list[GenerateStream]:
    streams = [GenerateStream(server, rid, tokens) for rid, tokens in specs]
    for s in streams:
        s.start()
    for s in streams:
        s.wait_started()
    return streams


def new_rid(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def assert_rid_rejected(client: httpx.Client, path: str, body: dict) -> None:
    try:
        r = send(client, "POST", path, body, timeout=DUPLICATE_RID_TIMEOUT_SECONDS)
    except httpx.TimeoutException:
        pytest.fail(f"a request with duplicate rid {body['rid']!r} on {path} hung instead of a 400")
    assert r.status_code == 400, (
        f"duplicate rid {body['rid']!r} on {path}: HTTP {r.status_code} {r.text[:300]}"
    )
    assert names_field(openai_error(r), "rid")


@pytest.mark.usefixtures("baseline")
def test_duplicate_rids_are_rejected_including_n_suffixes(server, client):
    """rid X with n=2 runs as X-0 and X-1: a second X, X-0 or X-1 is a 400, and X still completes."""
    rid = new_rid("dup")
    body = {
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": LONG_TOKENS,
        "ignore_eos": True,
        "n": 2,
        "rid": rid,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with httpx.stream(
        "POST",
        f"{server.openai_base_url}/chat/completions",
        json=body,
        headers=server.headers,
        timeout=STREAM_END_TIMEOUT_SECONDS,
    ) as stream:
        assert stream.status_code == 200, stream.read()
        lines = stream.iter_lines()
        for line in lines:  # wait for the first chunk: the request is running
            if line.startswith("data: "):
                chunks.append(json.loads(line[len("data: ") :]))
                break
        assert_rid_rejected(
            client, GEN, {"text": "hi", "rid": f"{rid}-0", "sampling_params": {"max_new_tokens": 2}}
        )
        assert_rid_rejected(client, CMPL, {"prompt": "hi", "max_tokens": 2, "rid": rid})
        assert_rid_rejected(client, CHAT, {"messages": MSGS, "max_tokens": 2, "rid": f"{rid}-1"})
        chunks += [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    finishes = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}, finishes
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * LONG_TOKENS, chunks[-1]


@pytest.mark.usefixtures("baseline")
def test_a_group_whose_suffixes_collide_with_a_running_rid_is_rejected(server, client):
    """A running rid Y-1 makes a new rid Y with n=2 (Y-0, Y-1) a duplicate, whatever the order."""
    base = new_rid("grp")
    (running,) = start_streams(server, (f"{base}-1", LONG_TOKENS))
    assert_rid_rejected(client, CMPL, {"prompt": "hi", "max_tokens": 2, "n": 2, "rid": base})
    meta = running.finish()
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == LONG_TOKENS, meta


@pytest.mark.usefixtures("baseline")
def test_abort_without_a_target_aborts_nothing(server, client):
    (running,) = start_streams(server, (new_rid("keep"), LONG_TOKENS))
    r = send(client, "POST", ABORT, {})
    assert r.status_code == 400, r.text
    meta = running.finish()
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == LONG_TOKENS, meta


@pytest.mark.usefixtures("baseline")
def test_abort_by_rid_aborts_only_that_request(server, client):
    victim, survivor = start_streams(
        server, (new_rid("victim"), VERY_LONG_TOKENS), (new_rid("survivor"), LONG_TOKENS)
    )
    r = send(client, "POST", ABORT, {"rid": victim.body["rid"]})
    assert r.status_code == 200, r.text
    assert victim.finish()["finish_reason"]["type"] == "abort"
    meta = survivor.finish()
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == LONG_TOKENS, meta


@pytest.mark.usefixtures("baseline")
def test_abort_all_aborts_every_running_request(server, client):
    streams = start_streams(
        server, (new_rid("all-a"), VERY_LONG_TOKENS), (new_rid("all-b"), VERY_LONG_TOKENS)
    )
    r = send(client, "POST", ABORT, {"abort_all": True})
    assert r.status_code == 200, r.text
    for s in streams:
        meta = s.finish()
        assert meta["finish_reason"]["type"] == "abort", meta
        assert meta["completion_tokens"] < VERY_LONG_TOKENS, meta


# ---- afterwards: the same processes, still serving ----
def test_the_same_processes_still_serve(server, client, baseline):
    """Runs last: no child was replaced, the launcher lives, and /metrics shows no new start."""
    assert server.proc.poll() is None, f"the launcher exited with {server.proc.returncode}"
    assert server.child_pids() == baseline.child_pids
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    r = client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    # Give the process-metrics threads a moment, so a restart would have been written by now.
    time.sleep(1.0)
    assert start_lines(client.get("/metrics").text) == baseline.start_lines
