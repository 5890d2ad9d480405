"""Specification of `logit_bias`: the sampler adds each request's biases before temperature (greedy rows
too), leaves rows without a bias exactly as they were, and the request boundary refuses every malformed map
naming `logit_bias`."""

from __future__ import annotations

import shutil

import pytest
import torch
from pydantic import ValidationError

from srt.http_server.input_processor import GenerateInput, InvalidRequestError
from srt.http_server.native_protocol import GenerateRequest
from srt.http_server.openai.errors import validation_error
from srt.http_server.openai.protocol import ChatCompletionRequest, CompletionRequest
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.io_struct import SchedulerReady
from srt.port_args import PortArgs
from srt.sampling.sampler import Sampler
from srt.sampling.sampling_batch import one_off_batch
from srt.sampling.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams, SamplingParamsError
from srt.server_args import ServerArgs

VOCAB = 50


def sample(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    bs = len(params)
    batch = one_off_batch(params, [[]] * bs, [[]] * bs, [None] * bs, VOCAB, [2])
    out = Sampler(VOCAB, eos_token_ids=[2]).sample(logits, batch)
    return out.next_token_ids


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(6, VOCAB)


def test_minus_100_bans_the_greedy_token(logits):
    top = logits[0].argmax().item()
    second = logits[0].topk(2).indices[1].item()
    assert sample(logits[:1], [greedy(logit_bias={top: -100.0})]) == [second]


def test_plus_100_forces_a_token_greedy_and_sampled(logits):
    forced = int(logits[0].argmin())
    assert sample(logits[:1], [greedy(logit_bias={forced: 100.0})]) == [forced]
    hot = SamplingParams(temperature=1.0, logit_bias={forced: 100.0})
    assert all(sample(logits[:1], [hot]) == [forced] for _ in range(20))


def test_rows_without_bias_keep_their_exact_tokens(logits):
    plain = [greedy() for _ in range(6)]
    unbiased = sample(logits, plain)
    mixed = list(plain)
    mixed[1] = greedy(logit_bias={unbiased[1]: -100.0, 7: 3.0})
    mixed[4] = greedy(logit_bias={int(logits[4].argmin()): 100.0})
    got = sample(logits, mixed)
    assert [got[i] for i in (0, 2, 3, 5)] == [unbiased[i] for i in (0, 2, 3, 5)]
    assert got[1] != unbiased[1] and got[4] == int(logits[4].argmin())


def test_the_callers_logits_are_not_modified(logits):
    before = logits.clone()
    sample(logits, [greedy(logit_bias={1: 50.0})] * 6)
    assert torch.equal(logits, before)


def test_sampling_params_verify_guards_the_scheduler():
    for bad in ({-1: 1.0}, {1: 101.0}, {1: float("nan")}, {"1": 1.0}, {1: True}):
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(logit_bias=bad).verify()
        assert info.value.param == "logit_bias"
    SamplingParams(logit_bias={0: -100, 5: 100.0}).verify()


# ---- the request boundary -----------------------------------------------------------------------------
MSGS = [{"role": "user", "content": "hi"}]
TOO_MANY = {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}
BAD_MAPS = [
    {"abc": 1},
    {"1.5": 1},
    {"-3": 1},
    {" 3": 1},
    {"3": 100.5},
    {"3": -101},
    {"3": True},
    {"3": "1"},
    {"3": None},
    [1, 2],
    "x",
    TOO_MANY,
]


def param_of(model, body: dict) -> str | None:
    from fastapi.exceptions import RequestValidationError

    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(RequestValidationError(info.value.errors())).param


@pytest.mark.parametrize("bias", BAD_MAPS, ids=range(len(BAD_MAPS)))
def test_malformed_logit_bias_is_refused_naming_it(bias):
    assert param_of(CompletionRequest, {"prompt": "x", "logit_bias": bias}) == "logit_bias"
    assert param_of(ChatCompletionRequest, {"messages": MSGS, "logit_bias": bias}) == "logit_bias"
    native = {"text": "x", "sampling_params": {"logit_bias": bias}}
    assert param_of(GenerateRequest, native) == "sampling_params.logit_bias"


def test_valid_logit_bias_reaches_the_sampling_params():
    req = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"50256": -100, "7": 2.5}})
    assert req.to_sampling_params(4, None).logit_bias == {50256: -100.0, 7: 2.5}
    native = GenerateRequest.model_validate({"text": "x", "sampling_params": {"logit_bias": {"3": 1}}})
    assert native.sampling_params.to_sampling_params(None).logit_bias == {3: 1.0}
    assert (
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": {}})
        .to_sampling_params(4, None)
        .logit_bias
        is None
    )


@pytest.fixture(scope="module")
def tm(embedded_model_dir):
    ports = PortArgs.create()
    manager = TokenizerManager(ServerArgs(disable_metrics=True), ports, embedded_model_dir)
    manager.set_ready(SchedulerReady(4096, 511, 512, 8, "torch_native"))
    yield manager
    shutil.rmtree(ports.ipc_dir, ignore_errors=True)


def test_token_ids_outside_the_vocabulary_are_refused(tm):
    obj = GenerateInput(
        prompts=[[1, 2, 3]], sampling_params=SamplingParams(logit_bias={tm.vocab_size: 1.0}), rid="lb"
    )
    with pytest.raises(InvalidRequestError) as info:
        tm.generate(obj)
    assert info.value.param == "logit_bias"
