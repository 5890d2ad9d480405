"""A reasoning model through a real server (docs/reasoning.md), without a real reasoning model: a tiny random
Qwen3 with SmolLM2's tokenizer and a Qwen3-shaped chat template
(it renders an assistant turn's `reasoning_content`, and an empty closed block when `enable_thinking` is
false), served with `--reasoning-parser qwen3`. A `regex` constraint steers its output into the shapes a
thinking model writes. The tags stay plain text of several tokens: the grammar libraries read an added token
as a special one, which no regex can write; so the thinking is counted by the decoded text of the output's
prefixes here (a one-token end tag, counted by its id, is covered by test/unit/test_chat_reasoning.py). The
client matrix of docs/reasoning.md runs here too: the `openai` client, SMG's chat path, lm-eval and guidellm,
each unchanged. One server serves every case."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import httpx
import openai
import pytest

from srt_bench.gateway import ROUND_ROBIN, running_gateway, smg_problem
from test.conftest import save_random_model
from test.integration.conftest import running_server
from test.integration.guidellm_client import guidellm_binary, run_guidellm
from test.model_families import COMMON

pytestmark = pytest.mark.slow

SEED = 11
TIMEOUT = 120.0
THINK_START, THINK_END = "<think>", "</think>"
# Qwen3's template, cut to what the tests read: the thinking of an assistant turn, and enable_thinking
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# a thought of lowercase words, then an answer; the body sizes keep each output far below max_tokens
THOUGHT_THEN_ANSWER = r"<think>\n[a-z]{3,8}( [a-z]{3,8}){1,3}\n</think>\n\n[a-z]{3,8}( [a-z]{3,8}){0,2}"
CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "think first"}]


@pytest.fixture(scope="module")
def qwen3_dir(model_assets_dir, tmp_path_factory) -> str:
    from transformers import AutoTokenizer, Qwen3Config

    out = tmp_path_factory.mktemp("tiny_qwen3_thinking")
    tokenizer = AutoTokenizer.from_pretrained(model_assets_dir)
    fields = {**COMMON, "eos_token_id": tokenizer.eos_token_id, "vocab_size": len(tokenizer)}
    config = Qwen3Config(**fields, num_hidden_layers=2, architectures=["Qwen3ForCausalLM"])
    save_random_model(out, model_assets_dir, SEED, config)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def server(qwen3_dir):
    flags = ("--model-path", qwen3_dir, "--quantization", "none", "--reasoning-parser", "qwen3")
    with running_server(*flags, "--tool-call-parser", "hermes") as handle:
        yield handle


def chat(server, **body) -> httpx.Response:
    body = {"messages": USER, "temperature": 0, "max_tokens": 64, **body}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=TIMEOUT)


def streamed(server, **body) -> tuple[str, str, dict, str]:
    """(reasoning_content, content, usage, finish_reason) of a streamed answer; `reasoning` always equal."""
    body = {"stream": True, "stream_options": {"include_usage": True}, **body}
    reasoning, other, content, usage, finish = "", "", "", None, None
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        json={"messages": USER, "temperature": 0, "max_tokens": 64, **body},
        timeout=TIMEOUT,
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                reasoning += delta.get("reasoning_content") or ""
                other += delta.get("reasoning") or ""
                content += delta.get("content") or ""
                finish = choice["finish_reason"] or finish
    assert other == reasoning
    return reasoning, content, usage, finish


def thinking_tokens(logprobs: dict) -> int:
    """How many output tokens reach the end of `</think>`, from the tokens' texts (chat logprobs)."""
    text = ""
    for k, entry in enumerate(logprobs["content"]):
        text += entry["token"]
        if THINK_END in text:
            return k + 1
    return 0


def test_thinking_and_answer_are_separated_and_counted(server):
    r = chat(server, regex=THOUGHT_THEN_ANSWER, logprobs=True)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    message = choice["message"]
    assert choice["finish_reason"] == "stop"
    words = message["reasoning_content"].split()
    assert 2 <= len(words) <= 4 and message["reasoning"] == message["reasoning_content"]
    assert message["content"] and THINK_END not in message["content"] and "\n" not in message["content"]
    spent = thinking_tokens(choice["logprobs"])
    assert 0 < spent < usage["completion_tokens"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == spent

    # the same answer streamed: the same split, and the same count in the usage chunk
    reasoning, content, s_usage, finish = streamed(server, regex=THOUGHT_THEN_ANSWER)
    assert (reasoning, content, finish) == (message["reasoning_content"], message["content"], "stop")
    assert s_usage["completion_tokens_details"]["reasoning_tokens"] == spent

    # separate_reasoning false: the raw text, still counted
    raw = chat(server, regex=THOUGHT_THEN_ANSWER, separate_reasoning=False).json()
    text = raw["choices"][0]["message"]["content"]
    assert text.startswith(THINK_START) and f"{THINK_END}\n\n{message['content']}" in text
    assert "reasoning_content" not in raw["choices"][0]["message"]
    assert raw["usage"]["completion_tokens_details"]["reasoning_tokens"] == spent


def test_max_tokens_inside_the_thinking_is_length_with_empty_content(server):
    body = {"regex": r"<think>\n[a-z]{40,60}\n</think>\n\nok", "max_tokens": 4, "tools": TOOLS}
    r = chat(server, **body)
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "" and "tool_calls" not in choice["message"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] == 4
    _, content, s_usage, finish = streamed(server, **body)
    assert (content, finish) == ("", "length")
    assert s_usage["completion_tokens_details"]["reasoning_tokens"] == 4


def test_a_tool_call_written_while_thinking_is_not_a_call(server):
    thought_call = r"<think>\n" + CALL.replace("{", r"\{").replace("}", r"\}") + r"\n</think>\n\nno"
    r = chat(server, regex=thought_call, tools=TOOLS)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["reasoning_content"] == CALL and choice["message"]["content"] == "no"


def test_thinking_turned_off_is_all_answer(server):
    r = chat(server, regex=r"[a-z]{3,8} [a-z]{3,8}", chat_template_kwargs={"enable_thinking": False})
    body = r.json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] is None and len(message["content"].split()) == 2
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning"])
def test_a_returned_thinking_reaches_the_template_under_either_name(server, name):
    from transformers import AutoTokenizer

    turn = {"role": "assistant", "content": "four", name: "two and two"}
    messages = [*USER, turn, {"role": "user", "content": "again"}]
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    tokenizer = AutoTokenizer.from_pretrained(server_model(server))
    assert "<|im_start|>assistant\n<think>\ntwo and two\n</think>\n\nfour<|im_end|>" in tokenizer.decode(
        r.json()["tokens"]
    )
    # and a chat that sends it is served
    assert chat(server, messages=messages, regex="[a-z]{3}").status_code == 200


def test_two_different_thinkings_in_one_message_are_a_400(server):
    turn = {"role": "assistant", "content": "x", "reasoning_content": "a", "reasoning": "b"}
    r = chat(server, messages=[*USER, turn, *USER])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1"
    assert chat(server, messages=[*USER, {**turn, "reasoning": "a"}, *USER], max_tokens=2).status_code == 200


def server_model(server) -> str:
    return server.flags[server.flags.index("--model-path") + 1]


def metric(server, name: str) -> float:
    """The sum of a family's samples named `name` on /metrics (one model, no custom labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=TIMEOUT).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_the_counter_is_the_sum_of_the_responses_reasoning_tokens(server):
    """Every route and shape that reports usage, against `sglang:reasoning_tokens_total`; the answers that
    came after a thinking are each one observation of the time to first answer token, which the response's
    timing reports beside (and after) its TTFT."""
    counter, ttfat = "sglang:reasoning_tokens_total", "sglang:time_to_first_answer_token_seconds_count"
    before, answered_before = metric(server, counter), metric(server, ttfat)
    reported = []
    whole = chat(server, regex=THOUGHT_THEN_ANSWER, n=2, return_timing=True).json()
    reported.append(whole["usage"]["completion_tokens_details"]["reasoning_tokens"])
    for choice in whole["choices"]:
        timing = choice["timing"]
        assert timing["time_to_first_token"] <= timing["time_to_first_answer_token"] <= timing["e2e_latency"]
    reported.append(
        streamed(server, regex=THOUGHT_THEN_ANSWER)[2]["completion_tokens_details"]["reasoning_tokens"]
    )
    cut = chat(server, regex=r"<think>\n[a-z]{40,60}\n</think>\n\nok", max_tokens=3).json()
    reported.append(cut["usage"]["completion_tokens_details"]["reasoning_tokens"])
    off = chat(server, regex="[a-z]{3}", chat_template_kwargs={"enable_thinking": False}).json()
    reported.append(off["usage"]["completion_tokens_details"]["reasoning_tokens"])
    body = {
        "prompt": "<|im_start|>assistant\n",
        "max_tokens": 64,
        "temperature": 0,
        "regex": THOUGHT_THEN_ANSWER,
    }
    completion = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=TIMEOUT).json()
    reported.append(completion["usage"]["completion_tokens_details"]["reasoning_tokens"])
    assert reported[0] > 0 and reported[2] == 3 and reported[3] == 0 and reported[4] > 0
    assert metric(server, counter) - before == sum(reported)
    # two chat samples, one stream, one completion answered after thinking; the enable_thinking-off answer
    # came with no thinking (its first answer token is observed too); the cut one never answered
    assert metric(server, ttfat) - answered_before == 5


def test_stop_strings_apply_to_the_answer_only(server):
    """A stop string written while thinking does not end the request; the same string in the answer does."""
    body = {"regex": r"<think>\nxyz stop here\n</think>\n\nabc stop now", "stop": ["stop"]}
    choice = chat(server, **body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] == "xyz stop here"
    assert choice["message"]["content"].strip() == "abc"
    reasoning, content, _, finish = streamed(server, **body)
    assert (reasoning, content.strip(), finish) == ("xyz stop here", "abc", "stop")


# ---------------------------------------------------------------- the client matrix (docs/reasoning.md, "Clients")
# Each client, unchanged, asks the server for one steered thinking-then-answer (the `regex` as a body extra,
# which every one of them passes through) and reports what it read: the answer, and the thinking where it
# reads one (None: it shows no thinking). docs/reasoning.md's matrix says the same in words.
# guidellm's arg strings split on commas, so its steering regex has none.
GUIDELLM_THOUGHT_THEN_ANSWER = r"<think>\n[a-z]{4} [a-z]{4}\n</think>\n\n[a-z]{4}"
GUIDELLM_REQUESTS = 2


@dataclass(frozen=True)
class Seen:
    """What a client read of one answer."""

    answer: str
    thinking: str | None


def served_name(server) -> str:
    return httpx.get(f"{server.openai_base_url}/models", timeout=TIMEOUT).json()["data"][0]["id"]


def openai_chat(base_url: str, model: str) -> Seen:
    """The `openai` client: the thinking is an extra field of the message, under either name."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=TIMEOUT)
    kw = {"model": model, "messages": USER, "temperature": 0, "max_tokens": 64}
    message = (
        client.chat.completions.create(**kw, extra_body={"regex": THOUGHT_THEN_ANSWER}).choices[0].message
    )
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
    return Seen(message.content, message.model_extra["reasoning_content"])


def openai_stream(base_url: str, model: str) -> Seen:
    """The `openai` client streaming: the deltas' extra fields, joined."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=TIMEOUT)
    kw = {"model": model, "messages": USER, "temperature": 0, "max_tokens": 64, "stream": True}
    answer, thinking, other = "", "", ""
    for chunk in client.chat.completions.create(**kw, extra_body={"regex": THOUGHT_THEN_ANSWER}):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            answer += choice.delta.content or ""
            thinking += extra.get("reasoning_content") or ""
            other += extra.get("reasoning") or ""
    assert other == thinking
    return Seen(answer, thinking)


def lm_eval_chat(base_url: str, model: str) -> Seen:
    """lm-evaluation-harness's `local-chat-completions`: generate_until reads `message.content` only."""
    api_models = pytest.importorskip("lm_eval.models.openai_completions", reason="lm-eval is not installed")
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr

    lm = api_models.LocalChatCompletion(
        base_url=f"{base_url}/chat/completions", model=model, num_concurrent=1, max_retries=1
    )
    gen_kwargs = {"until": [], "max_gen_toks": 64, "regex": THOUGHT_THEN_ANSWER}
    request = Instance("generate_until", doc={}, arguments=(JsonChatStr(json.dumps(USER)), gen_kwargs), idx=0)
    (answer,) = lm.generate_until([request], disable_tqdm=True)
    return Seen(answer, None)


def via_gateway(read):
    """`read` through the Shepherd Model Gateway in front of the server (SMG's chat path, HTTP mode)."""

    def through(base_url: str, model: str) -> Seen:
        if smg_problem() is not None:
            pytest.skip(str(smg_problem()))
        with running_gateway([base_url.removesuffix("/v1")], ROUND_ROBIN) as gw:
            return read(f"{gw.base_url}/v1", model)

    return through


CLIENTS = {
    "openai-chat": openai_chat,
    "openai-stream": openai_stream,
    "smg-chat": via_gateway(openai_chat),
    "smg-stream": via_gateway(openai_stream),
    "lm-eval-chat": lm_eval_chat,
}


@pytest.mark.parametrize("name", CLIENTS)
def test_each_client_reads_the_answer_alone(server, name):
    """Every client gets the server's own answer (the thinking never leaks into it) and, where it reads one,
    the server's own thinking."""
    reference = chat(server, regex=THOUGHT_THEN_ANSWER).json()["choices"][0]["message"]
    seen = CLIENTS[name](server.openai_base_url, served_name(server))
    assert seen.answer == reference["content"] and THINK_END not in seen.answer
    assert seen.thinking in (None, reference["reasoning_content"])
    assert (seen.thinking is None) == (name == "lm-eval-chat")


@pytest.mark.skipif(guidellm_binary() is None, reason="guidellm is not installed (pip install guidellm)")
def test_guidellm_reads_the_thinking_and_the_answer_apart(server, tmp_path):
    """guidellm streams chat and keeps each request's thinking (`reasoning`, else `reasoning_content`) apart
    from its output; its synthetic prompts differ from ours, so the shapes are checked, not the words."""
    regex = f",extras.body.regex={GUIDELLM_THOUGHT_THEN_ANSWER}"
    bench = run_guidellm(
        server.base_url, server_model(server), GUIDELLM_REQUESTS, 16, 48, tmp_path / "guidellm.json", regex
    )
    done, state = bench["requests"]["successful"], bench["scheduler_state"]
    counts = {k: v for k, v in state.items() if k.endswith("_requests")}
    errors = [(r.get("info") or {}).get("error") for r in bench["requests"].get("errored") or []]
    assert len(done) == GUIDELLM_REQUESTS and state["errored_requests"] == 0, (counts, errors)
    for r in done:
        assert re.fullmatch("[a-z]{4}", r["output"]), r
        assert re.fullmatch("[a-z]{4} [a-z]{4}", r["reasoning_output"]), r
