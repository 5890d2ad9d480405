"""Every parameter of the "Parameters" table in docs/api.md, checked against a real server.

The table is parsed from docs/api.md: each cell (chat, completions, `/generate`'s sampling_params) is a claim —
honoured (the output shows it), refused (a 400 naming it), ignored (accepted, output unchanged) or — (not a
parameter there: a 400 naming it) — and each claim is tested here, streaming and not. The table must list
exactly the request models' fields and every parameter of the installed `openai` client, so the table,
the models and the behaviour cannot drift apart. Chat and completions go through the real `openai` client
(non-standard fields in `extra_body`), `/generate` through httpx.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
import uuid
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from openai.resources.chat.completions import Completions as ChatResource
from openai.resources.completions import Completions as CompletionResource
from pydantic import BaseModel

from srt.http_server.native_protocol import (
    AbortRequest,
    FlushCacheRequest,
    GenerateRequest,
    LoadLoRAAdapterRequest,
    NativeSamplingParams,
    UnloadLoRAAdapterRequest,
)
from srt.http_server.openai.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from srt.http_server.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from test.integration.conftest import REPO_ROOT, ServerHandle

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 120.0
ROUTES = ("chat", "completions", "generate")
REPEAT = "The the the the the the"  # greedy output repeats: penalties visibly change it
# Greedy output ends (EOS) within a few tokens: min_tokens / ignore_eos visibly extend it.
SHORT = {"chat": "Answer yes or no: is the sky blue?", "prompt": "Q: Is the sky blue? Answer yes or no.\nA:"}
FORCED = 1000  # a token id that logit_bias +100 forces
TINY_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# A valid value of every parameter, sent where the table says refused, ignored or —.
SAMPLE = {
    "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "model": MODEL, "max_tokens": 2,
    "max_completion_tokens": 2, "max_new_tokens": 2, "min_new_tokens": 1, "n": 1, "best_of": 1,
    "stream": False, "stream_options": {"include_usage": True}, "stop": ["x"], "seed": 1,
    "temperature": 0.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "logit_bias": {"1": 1}, "logprobs": 1, "top_logprobs": 1, "echo": True, "suffix": "x",
    "response_format": {"type": "text"}, "modalities": ["text"], "tools": [TOOL], "tool_choice": "none",
    "parallel_tool_calls": True, "functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low",
    "moderation": {"model": "omni-moderation-latest"}, "user": "u", "metadata": {"k": "v"}, "store": True,
    "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit"}, "top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0,
    "stop_token_ids": [1], "ignore_eos": False, "skip_special_tokens": True,
    "json_schema": '{"type": "object"}', "regex": "a", "ebnf": 'root ::= "a"', "min_tokens": 1, "rid": "x",
    "return_timing": True, "stream_options.continuous_usage_stats": True, "data_parallel_rank": 0,
    "separate_reasoning": False, "chat_template_kwargs": {"enable_thinking": False},
}  # fmt: skip


# ---------------------------------------------------------------- the documented table
def documented_table() -> dict[str, dict[str, str]]:
    """{parameter: {route: status}} from docs/api.md's parameter table; status honoured/refused/ignored/tools/—."""
    lines = (REPO_ROOT / "docs" / "api.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| parameter | chat | completions |"))
    table: dict[str, dict[str, str]] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        statuses = ["tools" if c == "honoured (see Tools)" else c for c in cells[1:4]]
        assert set(statuses) <= {"honoured", "refused", "ignored", "tools", "—"}, line
        for name in re.findall(r"`([^`]+)`", cells[0]):
            assert name not in table, f"{name} is listed twice"
            table[name] = dict(zip(ROUTES, statuses, strict=True))
    return table


TABLE = documented_table()


def cases() -> list:
    out = []
    for name, statuses in TABLE.items():
        for route, status in statuses.items():
            for stream in (False, True):
                if stream and (route, name) in {("generate", "n")}:
                    continue  # /generate streams one sample only
                out.append(pytest.param(route, name, status, stream, id=f"{route}-{name}-{status}-{stream}"))
    return out


# ---------------------------------------------------------------- one client for three routes
@dataclass
class Out:
    texts: list[str]
    finish: list[str | None]
    prompt_tokens: int
    completion_tokens: int
    ids: list[list[int]] = field(default_factory=list)  # /generate only
    tops: list[list[int]] = field(default_factory=list)  # per choice, per token: alternatives returned
    logprob_sums: list[float] = field(default_factory=list)
    id: str = ""
    timings: list[dict | None] = field(default_factory=list)  # per choice: its `timing` object, if any
    completion_details: dict | None = None  # usage.completion_tokens_details, if any


class Refused(Exception):
    def __init__(self, status: int, error: dict):
        super().__init__(f"{status}: {error}")
        self.status, self.error = status, error


class Api:
    def __init__(self, server: ServerHandle, route: str):
        self.server, self.route = server, route
        self.limit = "max_new_tokens" if route == "generate" else "max_tokens"

    def call(self, streaming: bool = False, text: str | None = None, **params) -> Out:
        """One request: greedy and 4 tokens unless `params` say otherwise; a non-200 raises Refused."""
        params.setdefault("temperature", 0.0)
        if not {"max_tokens", "max_completion_tokens", "max_new_tokens"} & params.keys():
            params[self.limit] = 4
        text = text or ("Say hi." if self.route == "chat" else "Hello, my name is")
        if self.route == "generate":
            return self._generate(text, streaming, params)
        if self.route == "chat":
            resource, body = ChatResource, {"messages": [{"role": "user", "content": text}]}
        else:
            resource, body = CompletionResource, {"prompt": text}
        body |= params
        known = set(inspect.signature(resource.create).parameters)
        kwargs = {"model": MODEL, "stream": streaming} | {k: v for k, v in body.items() if k in known}
        if streaming:
            kwargs.setdefault("stream_options", {"include_usage": True})
        client = self.server.openai_client(timeout=TIMEOUT)
        create = client.chat.completions.create if self.route == "chat" else client.completions.create
        try:
            result = create(**kwargs, extra_body={k: v for k, v in body.items() if k not in known})
        except openai.APIStatusError as e:
            raise Refused(e.status_code, e.body) from None
        chunks = [c.model_dump() for c in result] if streaming else [result.model_dump()]
        return self._collect(chunks)

    def _collect(self, chunks: list[dict]) -> Out:
        out = Out([], [], 0, 0, id=chunks[0]["id"])
        for chunk in chunks:
            if chunk.get("usage"):
                out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                out.completion_tokens = chunk["usage"]["completion_tokens"]
                out.completion_details = chunk["usage"].get("completion_tokens_details")
            for c in chunk["choices"]:
                i = c["index"]
                while len(out.texts) <= i:
                    out.texts.append(""), out.finish.append(None), out.tops.append([])
                    out.logprob_sums.append(0.0), out.timings.append(None)
                if c.get("timing"):
                    out.timings[i] = c["timing"]
                part = c.get("message") or c.get("delta")
                out.texts[i] += (part["content"] or "") if part else c["text"]
                out.finish[i] = c["finish_reason"] or out.finish[i]
                lp = c.get("logprobs") or {}
                if "tokens" in lp:  # completions: parallel lists
                    out.tops[i] += [len(t or {}) for t in lp["top_logprobs"] or [{}] * len(lp["tokens"])]
                    out.logprob_sums[i] += sum(v for v in lp["token_logprobs"] if v is not None)
                else:  # chat: one entry per token
                    out.tops[i] += [len(e["top_logprobs"]) for e in lp.get("content") or []]
                    out.logprob_sums[i] += sum(e["logprob"] for e in lp.get("content") or [])
        return out

    def _generate(self, text: str, streaming: bool, params: dict) -> Out:
        body = {"text": text, "sampling_params": params, "stream": streaming}
        r = httpx.post(
            f"{self.server.base_url}/generate", json=body, headers=self.server.headers, timeout=TIMEOUT
        )
        if r.status_code != 200:
            raise Refused(r.status_code, r.json()["error"])
        if streaming:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            results = [events[-1]]  # each event carries everything so far
        else:
            results = r.json() if isinstance(r.json(), list) else [r.json()]
        metas = [x["meta_info"] for x in results]
        return Out(
            texts=[x["text"] for x in results],
            finish=[(m["finish_reason"] or {}).get("type") for m in metas],
            prompt_tokens=metas[0]["prompt_tokens"],
            completion_tokens=sum(m["completion_tokens"] for m in metas),
            ids=[x["output_ids"] for x in results],
        )

    def refused(self, streaming: bool = False, status: int = 400, **params) -> dict:
        with pytest.raises(Refused) as info:
            self.call(streaming, **params)
        assert info.value.status == status, info.value.error
        return info.value.error


def same_as_greedy(api: Api, stream: bool, **params) -> None:
    """`params` turn sampling at temperature 1.5 (under any seed) back into greedy decoding."""
    base = api.call(stream, text=REPEAT, **{api.limit: 6})
    for seed in (1, 2):
        out = api.call(stream, text=REPEAT, **{api.limit: 6, "temperature": 1.5, "seed": seed, **params})
        assert out.texts == base.texts, params


def changes_output(api: Api, stream: bool, **params) -> None:
    base = api.call(stream, text=REPEAT, **{api.limit: 8})
    assert api.call(stream, text=REPEAT, **{api.limit: 8}, **params).texts != base.texts, params


def forced(api: Api, stream: bool, tokens: int, **params) -> Out:
    bias = {"logit_bias": {str(FORCED): 100}, "ignore_eos": True}
    return api.call(stream, **{api.limit: tokens}, **bias, **params)


# ---------------------------------------------------------------- honoured: what each one visibly does
def check_prompt(api: Api, stream: bool, name: str) -> None:
    short, long = api.call(stream, text="Hi"), api.call(stream, text="Hi there, how are you doing today?")
    assert long.prompt_tokens > short.prompt_tokens > 0


def check_model(api: Api, stream: bool, name: str) -> None:
    assert api.call(stream, model=MODEL).texts
    assert api.refused(stream, status=404, model="gpt-none")["param"] == "model"


def check_max_tokens(api: Api, stream: bool, name: str) -> None:
    out = api.call(stream, **{name: 3}, ignore_eos=True)
    assert out.completion_tokens == 3 and out.finish == ["length"]


def check_min_tokens(api: Api, stream: bool, name: str, **extra) -> None:
    prompt = SHORT["chat" if api.route == "chat" else "prompt"]
    base = api.call(stream, text=prompt, **{api.limit: 5})
    assert base.completion_tokens < 5 and base.finish == ["stop"]
    longer = api.call(stream, text=prompt, **{api.limit: 5}, **(extra or {name: 5}))
    assert longer.completion_tokens == 5


def check_n(api: Api, stream: bool, name: str) -> None:
    out = api.call(stream, n=3, temperature=1.0)
    assert len(out.texts) == 3 and None not in out.finish


def check_best_of(api: Api, stream: bool, name: str) -> None:
    assert api.refused(stream, best_of=1, n=2)["param"] == "best_of"
    if stream:
        assert api.refused(stream, best_of=3)["param"] == "best_of"
        assert len(api.call(stream, best_of=2, n=2).texts) == 2
        return
    out = api.call(text=REPEAT, best_of=4, n=2, temperature=1.5, ignore_eos=True, max_tokens=4)
    assert len(out.texts) == 2 and out.completion_tokens == 4 * 4  # usage counts every generated sample
    assert out.tops == [[], []]  # logprobs were used to rank, not returned unasked
    ranked = api.call(text=REPEAT, best_of=4, n=2, temperature=1.5, ignore_eos=True, max_tokens=4, logprobs=0)
    assert ranked.logprob_sums[0] >= ranked.logprob_sums[1]


def check_stream(api: Api, stream: bool, name: str) -> None:
    assert api.call(True, max_tokens=6).texts == api.call(False, max_tokens=6).texts  # type: ignore[arg-type]


def check_stream_options(api: Api, stream: bool, name: str) -> None:
    out = api.call(True, stream_options={"include_usage": True, "include_obfuscation": False})
    assert out.completion_tokens > 0
    assert "stream_options" in api.refused(stream_options={"include_usage": "yes"})["param"]


def check_continuous_usage_stats(api: Api, stream: bool, name: str) -> None:
    """Always streamed (it is a stream option): with include_usage, every chunk of a choice carries that
    choice's usage so far, counting up to the closing chunk's; without include_usage, none does."""
    client = api.server.openai_client(timeout=TIMEOUT)
    create = client.chat.completions.create if api.route == "chat" else client.completions.create
    body = (
        {"messages": [{"role": "user", "content": "Say hi."}]} if api.route == "chat" else {"prompt": "Hello"}
    )
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(create(model=MODEL, max_tokens=5, temperature=0, stream=True, stream_options=options,
                         extra_body={"ignore_eos": True}, **body))  # fmt: skip
    running = [c.usage.completion_tokens for c in chunks if c.choices]
    assert len(running) >= 5 and running == sorted(running) and running[-1] == 5
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0 for c in chunks)
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5
    plain = list(create(model=MODEL, max_tokens=5, temperature=0, stream=True,
                        stream_options={"continuous_usage_stats": True}, **body))  # fmt: skip
    assert all(c.usage is None for c in plain)


def check_data_parallel_rank(api: Api, stream: bool, name: str) -> None:
    # This server runs one replica: rank 0 is it; test_server_dp.py routes over two.
    assert api.call(stream, data_parallel_rank=0).texts == api.call(stream).texts
    assert api.refused(stream, data_parallel_rank=1)["param"] == "data_parallel_rank"
    assert api.refused(stream, data_parallel_rank=True)["param"] == "data_parallel_rank"


def check_stop(api: Api, stream: bool, name: str) -> None:
    base = api.call(stream, text=REPEAT, **{api.limit: 8}).texts[0]
    stop = base[3:6]
    out = api.call(stream, text=REPEAT, **{api.limit: 8}, stop=[stop])
    assert out.texts == [base[: base.index(stop)]] and out.finish == ["stop"]


def check_seed(api: Api, stream: bool, name: str) -> None:
    a, b = (api.call(stream, text=REPEAT, temperature=1.5, seed=1234, **{api.limit: 6}) for _ in range(2))
    assert a.texts == b.texts


def check_temperature(api: Api, stream: bool, name: str) -> None:
    same_as_greedy(api, stream, temperature=0.0)
    texts = {
        api.call(stream, text=REPEAT, temperature=1.5, seed=s, **{api.limit: 6}).texts[0] for s in range(3)
    }
    assert len(texts) > 1


def check_logit_bias(api: Api, stream: bool, name: str) -> None:
    one, three = forced(api, stream, 1), forced(api, stream, 3)
    assert three.texts == [one.texts[0] * 3]
    if api.route == "generate":
        assert three.ids == [[FORCED] * 3]


def check_stop_token_ids(api: Api, stream: bool, name: str) -> None:
    out = forced(api, stream, 4, stop_token_ids=[FORCED])
    assert out.completion_tokens == 1 and out.finish == ["stop"]


def check_logprobs(api: Api, stream: bool, name: str) -> None:
    out = api.call(stream, logprobs=True) if api.route == "chat" else api.call(stream, logprobs=2)
    assert len(out.tops[0]) == out.completion_tokens > 0
    assert all(t == 0 for t in out.tops[0]) if api.route == "chat" else all(1 <= t <= 2 for t in out.tops[0])


def check_top_logprobs(api: Api, stream: bool, name: str) -> None:
    assert api.call(stream, logprobs=True, top_logprobs=3, ignore_eos=True).tops[0] == [3] * 4
    assert api.refused(stream, top_logprobs=3)["param"] == "top_logprobs"


def check_echo(api: Api, stream: bool, name: str) -> None:
    assert api.call(stream, text="Hello there", echo=True).texts[0].startswith("Hello there")


def check_structured(api: Api, stream: bool, name: str) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": TINY_SCHEMA}}
    value = {"response_format": schema, "json_schema": json.dumps(TINY_SCHEMA)}.get(name)
    if value is not None:
        assert isinstance(
            json.loads(api.call(stream, **{name: value}, **{api.limit: 16}).texts[0])["a"], bool
        )
    else:
        grammar = "(yes|no)" if name == "regex" else 'root ::= "yes" | "no"'
        assert api.call(stream, **{name: grammar}, **{api.limit: 8}).texts[0] in {"yes", "no"}


def check_modalities(api: Api, stream: bool, name: str) -> None:
    assert api.call(stream, modalities=["text"]).texts == api.call(stream).texts
    assert api.refused(stream, modalities=["text", "audio"])["param"] == "modalities"


def check_skip_special_tokens(api: Api, stream: bool, name: str) -> None:
    prompt = SHORT["chat" if api.route == "chat" else "prompt"]
    shown = api.call(stream, text=prompt, ignore_eos=True, skip_special_tokens=False, **{api.limit: 6})
    hidden = api.call(stream, text=prompt, ignore_eos=True, **{api.limit: 6})
    assert "<|im_end|>" in shown.texts[0] and "<|im_end|>" not in hidden.texts[0]


def check_rid(api: Api, stream: bool, name: str) -> None:
    rid = uuid.uuid4().hex
    assert api.call(stream, rid=rid).id == ("chatcmpl-" if api.route == "chat" else "cmpl-") + rid


def check_tools(api: Api, stream: bool, name: str) -> None:
    # Only accepted here; the tools' own tests (tool calls, streaming deltas) live with the tools work.
    assert api.call(stream, tools=[TOOL], tool_choice="none", parallel_tool_calls=True).texts


def check_return_timing(api: Api, stream: bool, name: str) -> None:
    assert api.call(stream).timings == [None]  # strict OpenAI clients see nothing new
    (timing,) = api.call(stream, return_timing=True).timings
    assert timing["e2e_latency"] > 0 and timing["request_received_ts"] < timing["response_sent_to_client_ts"]


def check_prediction(api: Api, stream: bool, name: str) -> None:
    """A prediction changes how fast an answer comes, never the answer: the same text with the answer itself
    (its tokens accepted), and with half of it then other words, as content parts (those drafts are
    rejected); usage reports both counts.
    A malformed one is a 400 naming it."""
    ask = {"text": REPEAT, api.limit: 12, "ignore_eos": True}
    base = api.call(stream, **ask)
    assert base.completion_details is None  # no prediction, no prediction counts
    exact = api.call(stream, **ask, prediction={"type": "content", "content": base.texts[0]})
    assert exact.texts == base.texts
    assert exact.completion_details["accepted_prediction_tokens"] > 0
    half = len(base.texts[0]) // 2
    parts = [{"type": "text", "text": base.texts[0][:half]}, {"type": "text", "text": " zebra quartz zebra"}]
    edited = api.call(stream, **ask, prediction={"type": "content", "content": parts})
    assert edited.texts == base.texts
    assert edited.completion_details["rejected_prediction_tokens"] > 0
    assert (
        api.refused(stream, **ask, prediction={"type": "audio", "content": "x"})["param"] == "prediction.type"
    )


def check_separate_reasoning(api: Api, stream: bool, name: str) -> None:
    """Without --reasoning-parser (this server) the output is raw either way; the split itself is
    test_reasoning_server.py's. A non-boolean is a 400 naming it."""
    assert api.call(stream, separate_reasoning=False).texts == api.call(stream).texts
    assert api.refused(stream, separate_reasoning="no")["param"] == "separate_reasoning"


def check_chat_template_kwargs(api: Api, stream: bool, name: str) -> None:
    """Variables reach the template (SmolLM2's reads none, so the answer is unchanged; Qwen3's
    `enable_thinking` is test_reasoning_server.py's); one of apply_chat_template's own arguments is a 400."""
    assert api.call(stream, chat_template_kwargs={"enable_thinking": False}).texts == api.call(stream).texts
    assert api.refused(stream, chat_template_kwargs={"tokenize": True})["param"] == "chat_template_kwargs"


HONOURED = {
    "messages": check_prompt, "prompt": check_prompt, "model": check_model, "max_tokens": check_max_tokens,
    "max_completion_tokens": check_max_tokens, "max_new_tokens": check_max_tokens,
    "min_new_tokens": check_min_tokens, "min_tokens": check_min_tokens, "n": check_n, "best_of": check_best_of,
    "stream": check_stream, "stream_options": check_stream_options, "stop": check_stop, "seed": check_seed,
    "temperature": check_temperature, "top_p": lambda a, s, n: same_as_greedy(a, s, top_p=1e-6),
    "top_k": lambda a, s, n: same_as_greedy(a, s, top_k=1), "min_p": lambda a, s, n: same_as_greedy(a, s, min_p=1.0),
    "presence_penalty": lambda a, s, n: changes_output(a, s, presence_penalty=2.0),
    "frequency_penalty": lambda a, s, n: changes_output(a, s, frequency_penalty=2.0),
    "repetition_penalty": lambda a, s, n: changes_output(a, s, repetition_penalty=2.0),
    "logit_bias": check_logit_bias, "stop_token_ids": check_stop_token_ids, "logprobs": check_logprobs,
    "top_logprobs": check_top_logprobs, "echo": check_echo, "response_format": check_structured,
    "json_schema": check_structured, "regex": check_structured, "ebnf": check_structured,
    "modalities": check_modalities, "ignore_eos": lambda a, s, n: check_min_tokens(a, s, n, ignore_eos=True),
    "skip_special_tokens": check_skip_special_tokens, "rid": check_rid,
    "tools": check_tools, "tool_choice": check_tools, "parallel_tool_calls": check_tools,
    "return_timing": check_return_timing, "prediction": check_prediction,
    "stream_options.continuous_usage_stats": check_continuous_usage_stats,
    "data_parallel_rank": check_data_parallel_rank, "separate_reasoning": check_separate_reasoning,
    "chat_template_kwargs": check_chat_template_kwargs,
}  # fmt: skip


# ---------------------------------------------------------------- the tests
def test_table_matches_the_request_models_and_the_openai_client():
    """Every parameter the code accepts or refuses is in the table and vice versa; every parameter the
    installed `openai` client can send is in the table; every honoured cell has a check."""
    # A dotted name is a field of a nested object (`stream_options.continuous_usage_stats`).
    nested = {p for p in TABLE if "." in p}
    assert {p.split(".", 1)[1] for p in nested} <= set(StreamOptions.model_fields)
    claimed = {route: {p for p, s in TABLE.items() if s[route] != "—"} - nested for route in ROUTES}
    chat = ChatCompletionRequest
    assert claimed["chat"] == set(chat.model_fields) | set(chat.refused)
    assert claimed["completions"] == set(CompletionRequest.model_fields) | set(CompletionRequest.refused)
    assert claimed["generate"] == set(NativeSamplingParams.model_fields)
    for resource in (ChatResource, CompletionResource):
        sent = set(inspect.signature(resource.create).parameters) - {"self", "timeout"}
        assert {p for p in sent if not p.startswith("extra_")} <= set(TABLE)
    assert set(TABLE) == set(SAMPLE)
    assert {p for p, s in TABLE.items() if {"honoured", "tools"} & set(s.values())} == set(HONOURED)


@pytest.fixture(scope="module")
def server(default_server):
    # fp32: some checks need what the fp32 model does with a prompt (e.g. an end of sequence within five
    # tokens, which min_tokens then postpones); int8 answers close to it, not token for token
    return default_server


@pytest.mark.parametrize("route,name,status,stream", cases())
def test_parameter(server: ServerHandle, route: str, name: str, status: str, stream: bool):
    api = Api(server, route)
    if status in ("honoured", "tools"):
        HONOURED[name](api, stream, name)
    elif status == "ignored":
        assert api.call(stream, **{name: SAMPLE[name]}).texts == api.call(stream).texts
    else:
        # a nested name is sent inside its object, which is what the route does not take
        top, _, inner = name.partition(".")
        error = api.refused(stream, **{top: {inner: SAMPLE[name]} if inner else SAMPLE[name]})
        assert top in error["param"], error
        assert ("is not supported" if status == "refused" else top) in error["message"]
        if status == "refused":
            api.call(stream, **{name: None})  # null means "not used"


def test_sglang_route_names_answer_beside_the_old_ones(server: ServerHandle):
    for new, old in (("/model_info", "/get_model_info"), ("/server_info", "/get_server_info")):
        a, b = (
            httpx.get(f"{server.base_url}{path}", headers=server.headers, timeout=TIMEOUT)
            for path in (new, old)
        )
        assert a.status_code == b.status_code == 200
        assert a.json().keys() == b.json().keys()


def test_server_info_reports_the_quantization_in_effect(server: ServerHandle):
    info = httpx.get(f"{server.base_url}/server_info", headers=server.headers, timeout=TIMEOUT).json()
    assert info["quantization"] == "none"


# ---------------------------------------------------------------- one rule for keys, on every route
UNKNOWN = "zz_unknown"
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
PARTS = [{"type": "text", "text": "hi"}]
# A valid body of every route that takes one, (route, body, the model it is, its answer without the unknown
# key); together they hold every kind of nested object those models have (checked below).
TOOL_TURNS = {
    "messages": [{"role": "user", "content": PARTS}, {"role": "assistant", "tool_calls": [TOOL_CALL]},
                 {"role": "tool", "tool_call_id": "c1", "content": "x"}],
    "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
}  # fmt: skip
BODIES = [
    ("/v1/chat/completions", {**TOOL_TURNS, "max_tokens": 1, "stream_options": {"include_usage": True},
                              "stream": True}, ChatCompletionRequest, 200),
    ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "metadata": {"k": "v"},
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TINY_SCHEMA}},
        "prediction": {"type": "content", "content": PARTS}, "logit_bias": {"1": 1},
    }, ChatCompletionRequest, 200),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "prediction": {"type": "content", "content": PARTS},
                         "stream": True, "stream_options": {"include_usage": True}}, CompletionRequest, 200),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "t", "schema": TINY_SCHEMA}}}, CompletionRequest, 200),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}, GenerateRequest, 200),
    ("/tokenize", TOOL_TURNS, TokenizeRequest, 200),
    ("/detokenize", {"tokens": [1, 2]}, DetokenizeRequest, 200),
    ("/abort_request", {"rid": "no-such-request"}, AbortRequest, 200),
    ("/flush_cache", {}, FlushCacheRequest, 200),
    # this server has no LoRA: the valid body is a 400 naming `lora_name`, after validation
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere", "pinned": False},
     LoadLoRAAdapterRequest, 400),
    ("/unload_lora_adapter", {"lora_name": "a"}, UnloadLoRAAdapterRequest, 400),
]  # fmt: skip
# Objects whose keys are the client's own (JSON schemas, metadata, token ids): no model, no key rule.
FREE_FORM = {"parameters", "schema", "metadata", "logit_bias"}


def object_paths(value, path: str = "") -> list[str]:
    """The dotted path of every JSON object in `value` that a model reads (free-form ones left out)."""
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in object_paths(v, f"{path}.{i}" if path else str(i))]
    if not isinstance(value, dict) or path.rsplit(".", 1)[-1] in FREE_FORM:
        return []
    inner = [p for k, v in value.items() for p in object_paths(v, f"{path}.{k}" if path else k)]
    return [path, *inner]


def with_key(body: dict, path: str, key: str) -> dict:
    body = json.loads(json.dumps(body))
    target = body
    for part in filter(None, path.split(".")):
        target = target[int(part) if isinstance(target, list) else part]
    target[key] = 1
    return body


def reachable_models(annotation, seen: set | None = None) -> set[type]:
    """Every model class a value of `annotation` can contain, itself included."""
    seen = set() if seen is None else seen
    for arg in typing.get_args(annotation):
        reachable_models(arg, seen)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation not in seen:
        seen.add(annotation)
        for f in annotation.model_fields.values():
            reachable_models(f.annotation, seen)
    return seen


def models_in(value) -> set[type]:
    if isinstance(value, BaseModel):
        return {type(value)}.union(*(models_in(getattr(value, n)) for n in type(value).model_fields))
    if isinstance(value, list | tuple):
        return set().union(*map(models_in, value))
    return set()


def test_the_bodies_hold_every_nested_object_of_every_route():
    """So the key test below reaches every model: a new nested object needs a place in BODIES."""
    for model in {m for _, _, m, _ in BODIES}:
        held = set().union(*(models_in(model.model_validate(b)) for _, b, m, _ in BODIES if m is model))
        assert held == reachable_models(model), model


@pytest.mark.parametrize(
    "route,body,status",
    [(r, b, s) for r, b, _, s in BODIES],
    ids=[f"{r}-{i}" for i, (r, *_) in enumerate(BODIES)],
)
def test_an_unknown_key_anywhere_in_a_body_is_a_400_naming_it(server: ServerHandle, route, body, status):
    with server.http_client(TIMEOUT) as client:
        assert client.post(route, json=body).status_code == status
        for path in object_paths(body):
            r = client.post(route, json=with_key(body, path, UNKNOWN))
            named = f"{path}.{UNKNOWN}" if path else UNKNOWN
            assert r.status_code == 400 and r.json()["error"]["param"] == named, (path, r.text)
            assert UNKNOWN in r.json()["error"]["message"]


def test_an_unknown_query_parameter_of_any_route_is_a_400_naming_it(server: ServerHandle):
    """Every route the server lists (its OpenAPI document), every method: query parameters are checked
    like body keys."""
    valid = {route: body for route, body, _, _ in BODIES}
    with server.http_client(TIMEOUT) as client:
        paths = client.get("/openapi.json").json()["paths"]
        assert {"/v1/loads", "/generate", "/v1/models/{model}", "/set_trace_level"} <= set(paths)
        for path, methods in paths.items():
            url = path.replace("{model}", MODEL)
            for method in methods:
                body = valid.get(
                    url.removeprefix("/v1") if url.startswith("/v1/") and url not in valid else url
                )
                r = client.request(method, url, params={UNKNOWN: "1"}, json=body)
                assert r.status_code == 400, (method, url, r.text)
                assert r.json()["error"]["param"] == UNKNOWN, (method, url, r.text)
        r = client.get("/v1/loads", params={"include": "bogus"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "include"
        assert client.get("/v1/loads", params={"include": "core,queues"}).status_code == 200
        assert client.get("/health").status_code == 200
