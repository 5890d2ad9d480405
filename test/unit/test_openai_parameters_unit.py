"""The OpenAI request models honour, refuse or (metadata only) ignore every parameter, never drop one
silently; `best_of` keeps the samples of highest cumulative logprob. The end-to-end table test is
test/integration/test_openai_parameters.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from srt.http_server.openai.protocol import CHAT_REFUSED, ChatCompletionRequest, CompletionRequest
from srt.http_server.openai.serving_common import ChoiceAcc
from srt.http_server.openai.serving_completions import best_of

MSGS = [{"role": "user", "content": "hi"}]


def error_of(model, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = info.value.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    return err["msg"], getattr(cause, "param", None) or ".".join(map(str, err["loc"]))


@pytest.mark.parametrize("name", sorted(CHAT_REFUSED))
def test_chat_refuses_features_it_lacks_naming_them(name):
    msg, param = error_of(ChatCompletionRequest, {"messages": MSGS, name: {"x": 1}})
    assert param == name and f"`{name}` is not supported: " in msg
    ChatCompletionRequest.model_validate({"messages": MSGS, name: None})  # null: not used


def test_suffix_is_refused_unless_null():
    msg, param = error_of(CompletionRequest, {"prompt": "a", "suffix": "b"})
    assert param == "suffix" and "fill-in-the-middle" in msg
    CompletionRequest.model_validate({"prompt": "a", "suffix": None})


@pytest.mark.parametrize(
    "model,body,name",
    [
        (ChatCompletionRequest, {"messages": MSGS, "frobnicate": 1}, "frobnicate"),
        (ChatCompletionRequest, {"messages": MSGS, "echo": True}, "echo"),  # a completions parameter
        (ChatCompletionRequest, {"messages": MSGS, "best_of": 2}, "best_of"),
        (CompletionRequest, {"prompt": "a", "max_completion_tokens": 2}, "max_completion_tokens"),
        (CompletionRequest, {"prompt": "a", "tools": []}, "tools"),
        (CompletionRequest, {"prompt": "a", "metadata": {}}, "metadata"),
        (CompletionRequest, {"prompt": "a", "frobnicate": None}, "frobnicate"),
    ],
)
def test_unknown_parameters_are_refused_naming_them(model, body, name):
    msg, param = error_of(model, body)
    assert param == name and "is not a parameter of" in msg


def test_metadata_only_parameters_are_accepted_with_their_types_checked():
    ignored = {
        "user": "u", "metadata": {"k": "v"}, "store": True, "service_tier": "flex", "safety_identifier": "s",
        "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }  # fmt: skip
    req = ChatCompletionRequest.model_validate({"messages": MSGS, **ignored})
    assert req.to_sampling_params(4, None) == ChatCompletionRequest(messages=MSGS).to_sampling_params(4, None)
    for bad in ({"store": "yes"}, {"metadata": {"k": 1}}, {"metadata": {str(i): "v" for i in range(17)}}):
        _, param = error_of(ChatCompletionRequest, {"messages": MSGS, **bad})
        assert param.startswith(next(iter(bad)))


def test_tool_parameters_are_accepted_and_kept():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"messages": MSGS, "tools": [tool], "tool_choice": "none", "parallel_tool_calls": False}
    req = ChatCompletionRequest.model_validate(body)
    assert [(t.type, t.function.name, t.function.parameters) for t in req.tools] == [
        ("function", "f", {"type": "object"})
    ]
    assert req.tool_choice == "none" and req.parallel_tool_calls is False


def test_modalities_text_only():
    ChatCompletionRequest.model_validate({"messages": MSGS, "modalities": ["text"]})
    msg, param = error_of(ChatCompletionRequest, {"messages": MSGS, "modalities": ["text", "audio"]})
    assert param == "modalities" and "text" in msg


@pytest.mark.parametrize(
    "body,ok",
    [
        ({"best_of": 3, "n": 2}, True),
        ({"best_of": 2, "n": 2, "stream": True}, True),
        ({"best_of": 1, "n": 2}, False),
        ({"best_of": 3, "stream": True}, False),
        ({"best_of": 0}, False),
        ({"best_of": 65}, False),
    ],
)
def test_best_of_bounds(body, ok):
    if ok:
        CompletionRequest.model_validate({"prompt": "a", **body})
    else:
        assert error_of(CompletionRequest, {"prompt": "a", **body})[1] == "best_of"


def choice(text: str, *logprobs: float) -> ChoiceAcc:
    return ChoiceAcc(text=text, token_logprobs=list(logprobs))


def test_best_of_keeps_the_highest_cumulative_logprob_per_prompt_best_first():
    samples = [
        choice("a", -1.0, -1.0), choice("b", -0.5), choice("c", -0.1, -0.1),  # prompt 0
        choice("d", -3.0), choice("e", -2.0), choice("f", -2.0),  # prompt 1: a tie keeps sample order
    ]  # fmt: skip
    assert [c.text for c in best_of(samples, 3, 2)] == ["c", "b", "e", "f"]
    assert [c.text for c in best_of(samples, 3, 1)] == ["c", "e"]
    assert best_of(samples, 2, 2) is samples
