"""A verify step isolates per-request failures as a plain step does (test_scheduler_fault_isolation.py), on a
tiny randomly initialised Llama: a drafting request whose verify-step sampling raises finishes with `error`
(one log line naming its rid), every other request of the step produces exactly the tokens it produces
without the fault, and the KV pool is whole again afterwards. Drafts come from NGRAM (an oracle proposer, so
that every request drafts at every step) and from OpenAI's `prediction` on a server without an algorithm."""

from __future__ import annotations

import logging

import pytest
import torch

from srt.sampling.sampler import Sampler, make_generator
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler import fault_isolation
from srt.scheduler.schedule_batch import Req
from srt.scheduler.scheduler import Scheduler
from srt.scheduler.step_sampler import IsolatingSampler
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import assert_pool_whole, prompts
from test.unit.test_speculative_scheduler import WORKLOAD, Oracle, make, whole_prefill_in_one_step

MAX_NEW = 12
SEEDED = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
SOURCES = ["ngram", "prediction"]


def workload() -> list:
    """Greedy requests (one with logprobs, one penalized with a min_new_tokens floor), a seeded sampled one
    (whose draws must not be disturbed), and the one a fault will hit, all arriving together: they verify in
    the same steps."""
    return [
        request("g0", WORKLOAD[0], greedy(MAX_NEW)),
        request("g1", WORKLOAD[1], greedy(MAX_NEW, logprobs=2)),
        request(
            "g2", WORKLOAD[2], greedy(MAX_NEW, frequency_penalty=0.5, min_new_tokens=4, stop_token_ids=[5])
        ),
        request("s3", WORKLOAD[3], SEEDED),
        request("poison", prompts(1, seed=99)[0], greedy(MAX_NEW, logprobs=1)),
    ]


@pytest.fixture(scope="module")
def without_speculation(tiny_model_dir) -> dict[str, list[int]]:
    """The workload's tokens decoded plainly: the oracle's drafts and the requests' predictions."""
    sched, _ = make(tiny_model_dir, spec=False)
    return {rid: c.output_ids for rid, c in drive(sched, {0: workload()}).items()}


def speculating(model_dir: str, source: str, outputs: dict[str, list[int]]) -> tuple[Scheduler, list]:
    """A scheduler whose every request drafts the workload's plain tokens from the first decode step on (the
    whole workload prefilled in the first step), and the workload."""
    reqs = workload()
    if source == "ngram":
        sched, _ = make(model_dir)
        sched.spec.proposer = Oracle(outputs)
    else:
        sched, _ = make(model_dir, spec=False)
        for req in reqs:
            req.prediction_ids = outputs[req.rid]
    whole_prefill_in_one_step(sched)
    return sched, reqs


@pytest.fixture(scope="module")
def without_fault(tiny_model_dir, without_speculation) -> dict[str, dict[str, list[int]]]:
    """Per source, each request's tokens and logprobs with speculation and no fault."""
    out = {}
    for source in SOURCES:
        sched, reqs = speculating(tiny_model_dir, source, without_speculation)
        res = drive(sched, {0: reqs})
        out[source] = {rid: (c.output_ids, c.token_logprobs) for rid, c in res.items()}
    return out


def smuggle(**fields):
    """After the prefill step, set fields of the poisoned request's parameters as a client could smuggle them
    past construction: its next sampling is a verify step's."""

    def on_step(step: int, sched: Scheduler) -> None:
        if step == 0:
            assert len(sched.live["poison"].output_ids) == 1
            params = sched.live["poison"].sampling_params
            for name, value in fields.items():
                setattr(params, name, value)

    return on_step


FAULTS = {
    "injected": None,  # the test hook (fault_isolation.TEST_FAULT_ENV), raising before the rows are processed
    "logit-bias-oov": smuggle(logit_bias={10**9: 1.0}),  # raises while expanding its parameters to its rows
    "logprobs-float": smuggle(logprobs=1.5),  # raises while reading its run's logprobs, its tokens chosen
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("source", SOURCES)
def test_a_request_whose_verify_step_sampling_raises_fails_alone(
    tiny_model_dir, without_speculation, without_fault, caplog, monkeypatch, source, fault
):
    if fault == "injected":
        monkeypatch.setenv(fault_isolation.TEST_FAULT_ENV, "poison")
    sched, reqs = speculating(tiny_model_dir, source, without_speculation)
    failed_in_verify: list[tuple[str, int]] = []  # (rid, requests verified in its step)
    accept = sched.spec.accept

    def recording(logits, verifying, *args):
        out = accept(logits, verifying, *args)
        failed = [r.rid for r in verifying if r.finished and r.finished_reason.type == "error"]
        failed_in_verify.extend((rid, len(verifying)) for rid in failed)
        return out

    sched.spec.accept = recording
    with caplog.at_level(logging.ERROR):
        res = drive(sched, {0: reqs}, on_step=FAULTS[fault])
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]

    [(rid, verified)] = failed_in_verify
    assert rid == "poison" and verified > 1  # failed in a verify step it shared with others
    assert res["poison"].finish.type == "error" and res["poison"].finish.message
    assert len(res["poison"].output_ids) <= fault_isolation.TEST_FAULT_DECODE_STEP
    for rid, (tokens, logprobs) in without_fault[source].items():
        if rid != "poison":
            assert res[rid].output_ids == tokens, rid
            assert res[rid].token_logprobs == pytest.approx(logprobs, abs=1e-5), rid
            assert res[rid].finish.type == "length", rid
    assert len(errors) == 1 and "poison" in errors[0].getMessage()
    assert_pool_whole(sched)
    assert sched.live == {}


def test_requests_that_survive_a_failed_verify_batch_keep_their_random_draws():
    """A verify batch that raises is verified again request by request; its rows are processed before
    verification draws, so a seeded request's tokens are those it gets alone."""
    vocab = 64
    logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(0))
    default = torch.Generator().manual_seed(0)

    def req(rid: str, **fields) -> Req:
        params = SamplingParams(temperature=1.0, **fields)
        r = Req(rid, [1, 2], params, generator=make_generator(params.seed, default))
        r.output_ids = [3]
        return r

    drafts = [[5, 6], [7, 8, 9], [10, 11]]  # rows 0-2, 3-6, 7-9
    sampler = IsolatingSampler(Sampler(vocab, eos_token_ids=[0]))
    alone = [
        sampler.verify(logits[rows], [req(f"s{i}", seed=10 + i)], [drafts[i]])[0][0]
        for i, rows in ((0, slice(0, 3)), (2, slice(7, 10)))
    ]
    bad = req("bad", seed=5, logit_bias={vocab: 1.0})  # a token outside the vocabulary
    reqs = [req("s0", seed=10), bad, req("s2", seed=12)]
    runs, accepted = sampler.verify(logits, reqs, drafts)

    assert [r.finished for r in reqs] == [False, True, False] and bad.finished_reason.type == "error"
    assert all(alone)
    assert runs[1] == [] and accepted[1] == 0
    assert [runs[0], runs[2]] == alone
