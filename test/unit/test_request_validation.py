"""The HTTP boundary's one definition of a valid request: strict types, 64-bit ranges, UTF-8 text only,
documented list limits, and the TokenizerManager's checks that need the model (vocabulary, context, rids).
No model runs: the request models are validated directly and the TokenizerManager sends to no scheduler."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from pydantic import ValidationError

from srt.http_server.input_processor import GenerateInput, InvalidRequestError
from srt.http_server.native_protocol import AbortRequest, FlushCacheRequest, GenerateRequest
from srt.http_server.openai.errors import validation_error
from srt.http_server.openai.protocol import ChatCompletionRequest, CompletionRequest
from srt.http_server.request_types import MAX_STOP_STRINGS
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.io_struct import SchedulerReady
from srt.port_args import PortArgs
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs

MSGS = [{"role": "user", "content": "hi"}]
CONTEXT = 512


def param_of(model, body: dict) -> str | None:
    """The `param` the HTTP layer reports for `body`; fails the test if the body is accepted."""
    from fastapi.exceptions import RequestValidationError

    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(RequestValidationError(info.value.errors())).param


BAD = [
    # (model, body, the param the error names, or names a part of)
    (CompletionRequest, {"prompt": "x", "n": True}, "n"),
    (CompletionRequest, {"prompt": "x", "n": 1.0}, "n"),
    (CompletionRequest, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "max_tokens": 2**63}, "max_tokens"),
    (CompletionRequest, {"prompt": "x", "seed": 2**64}, "seed"),
    (CompletionRequest, {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    (CompletionRequest, {"prompt": "x", "seed": "abc"}, "seed"),
    (CompletionRequest, {"prompt": "x", "seed": 1.5}, "seed"),
    (CompletionRequest, {"prompt": "x", "temperature": True}, "temperature"),
    (CompletionRequest, {"prompt": "x", "temperature": float("nan")}, "temperature"),
    (CompletionRequest, {"prompt": "x", "top_p": float("inf")}, "top_p"),
    (CompletionRequest, {"prompt": "x", "top_k": 0}, "top_k"),
    (CompletionRequest, {"prompt": "x", "stream": "yes"}, "stream"),
    (CompletionRequest, {"prompt": "x", "echo": 1}, "echo"),
    (CompletionRequest, {"prompt": "x", "logprobs": True}, "logprobs"),
    (CompletionRequest, {"prompt": "x", "stop": 7}, "stop"),
    (CompletionRequest, {"prompt": "x", "stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    (CompletionRequest, {"prompt": "x", "stop": ["x" * 1000]}, "stop"),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": [2**63]}, "stop_token_ids"),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": ["x"]}, "stop_token_ids"),
    (CompletionRequest, {"prompt": [1, -2]}, "prompt"),
    (CompletionRequest, {"prompt": [1, 2**70]}, "prompt"),
    (CompletionRequest, {"prompt": [1, [2]]}, "prompt"),
    (CompletionRequest, {"prompt": [[1], []]}, "prompt"),
    (CompletionRequest, {"prompt": [[[1]]]}, "prompt"),
    (CompletionRequest, {"prompt": []}, "prompt"),
    (CompletionRequest, {"prompt": ["a"] * 65}, "prompt"),
    (CompletionRequest, {"prompt": "\ud800"}, "prompt"),
    (CompletionRequest, {"prompt": "x", "rid": ""}, "rid"),
    (CompletionRequest, {"prompt": "x", "rid": "a\nb"}, "rid"),
    (ChatCompletionRequest, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    (ChatCompletionRequest, {"messages": MSGS, "model": "\ud800"}, "model"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content.0.image_url",
    ),
    (ChatCompletionRequest, {"messages": MSGS * 1025}, "messages"),
    (GenerateRequest, {"text": "x", "sampling_params": {"seed": 2**64}}, "sampling_params.seed"),
    (GenerateRequest, {"text": "x", "sampling_params": {"stop": {"a": 1}}}, "sampling_params.stop"),
    (
        GenerateRequest,
        {"text": "x", "sampling_params": {"max_new_tokens": "5"}},
        "sampling_params.max_new_tokens",
    ),
    (GenerateRequest, {"text": "x", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    (GenerateRequest, {"text": "x", "sampling_params": [1]}, "sampling_params"),
    (GenerateRequest, {"text": "x", "return_logprob": True, "top_logprobs_num": True}, "top_logprobs_num"),
    (GenerateRequest, {"text": [1, 2]}, "text"),
    (GenerateRequest, {"input_ids": "abc"}, "input_ids"),
    (GenerateRequest, {"text": "x", "input_ids": [1]}, "text"),
    (GenerateRequest, {}, "text"),
    (AbortRequest, {}, "rid"),
    (AbortRequest, {"rid": ""}, "rid"),
    (AbortRequest, {"rid": 5}, "rid"),
    (AbortRequest, {"rid": "a", "abort_all": True}, "rid"),
    (AbortRequest, {"abort_all": "yes"}, "abort_all"),
    (FlushCacheRequest, {"everything": True}, "everything"),
]


@pytest.mark.parametrize(
    ("model", "body", "param"), BAD, ids=[f"{m.__name__}-{p}-{i}" for i, (m, _, p) in enumerate(BAD)]
)
def test_invalid_values_are_refused_naming_the_field(model, body, param):
    got = param_of(model, body)
    assert got == param or got.startswith(param + ".")  # list items are named down to their index


def test_valid_forms_are_accepted_and_normalised():
    assert CompletionRequest.model_validate({"prompt": "x"}).prompts() == ["x"]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"prompt": "x", "stop": "END"}).stop == ["END"]
    # OpenAI's nullable fields take null and mean their default
    req = ChatCompletionRequest.model_validate({"messages": MSGS, "n": None, "stop": None, "seed": None})
    assert req.num_samples == 1 and req.stop == []
    # ints are valid floats; seeds span the whole int64 range
    assert CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "seed": -(2**63)}).seed == -(
        2**63
    )
    gen = GenerateRequest.model_validate({"input_ids": [[1, 2], [3]], "sampling_params": {"n": 2}})
    assert gen.input_ids == [[1, 2], [3]] and gen.batched_input
    assert not GenerateRequest.model_validate({"text": "x"}).batched_input
    assert AbortRequest.model_validate({"abort_all": True}).abort_all


def test_native_and_openai_sampling_build_the_same_params():
    native = GenerateRequest.model_validate(
        {"text": "x", "sampling_params": {"max_new_tokens": 5, "temperature": 0.5, "seed": 3, "stop": "S"}}
    ).sampling_params.to_sampling_params(logprobs=None)
    openai = CompletionRequest.model_validate(
        {"prompt": "x", "temperature": 0.5, "seed": 3, "stop": "S"}
    ).to_sampling_params(5, None)
    assert native == openai


@pytest.fixture(scope="module")
def tm(embedded_model_dir):
    args = ServerArgs(disable_metrics=True)
    ports = PortArgs.create()
    manager = TokenizerManager(args, ports, embedded_model_dir)
    manager.set_ready(SchedulerReady(4096, CONTEXT - 1, CONTEXT, 8, "torch_native"))
    yield manager
    shutil.rmtree(ports.ipc_dir, ignore_errors=True)


def request(rid: str, n: int = 1, **params) -> GenerateInput:
    return GenerateInput(
        prompts=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=4, **params), n=n, rid=rid
    )


def test_rids_in_use_are_refused_whatever_their_origin(tm):
    tm.generate(request("X", n=2))  # internal rids
    for rid in ("X", "X-0", "X-1"):
        with pytest.raises(InvalidRequestError, match="collides"):
            tm.generate(request(rid))
    tm.generate(request("Y-1"))
    with pytest.raises(InvalidRequestError, match="collides"):
        tm.generate(request("Y", n=2))  # its sample Y-1 would collide


def test_model_dependent_limits(tm):
    with pytest.raises(InvalidRequestError) as info:
        tm.generate(request("v1", stop_token_ids=[tm.vocab_size]))
    assert info.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError) as info:
        tm.generate(request("v2", min_new_tokens=5))
    assert info.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError) as info:
        tm.inputs.decode_prompt([tm.vocab_size])
    assert info.value.param == "prompt"
    assert tm.check(request("v3", top_k=tm.vocab_size))[0].top_k == -1  # the whole vocabulary, as asked


def test_text_is_refused_by_size_before_tokenizing(tm):
    too_long = "a" * (tm.inputs.max_input_chars + 1)
    with pytest.raises(InvalidRequestError, match="characters"):
        asyncio.run(tm.inputs.encode(too_long))
    long_ok = "word " * 2000  # above the inline limit: tokenized on a worker thread, same result
    assert asyncio.run(tm.inputs.encode(long_ok)) == tm.tokenizer(long_ok).input_ids
