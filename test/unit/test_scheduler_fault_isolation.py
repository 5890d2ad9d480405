"""The scheduler isolates per-request failures, on a tiny randomly initialised Llama: a request whose admission,
sampling or stop check raises finishes with `error` (one log line naming its rid), every other request of the
batch produces exactly the tokens it produces alone, and the KV pool is whole again afterwards. Failures of the
process (out of memory) are not isolated."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from srt.sampling.sampling_params import SamplingParams
from srt.scheduler import fault_isolation
from srt.scheduler.scheduler import Scheduler
from srt.scheduler.step_sampler import IsolatingSampler
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import assert_pool_whole, make_scheduler, prompts

MAX_NEW = 10
SEEDED = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)


def clean_requests() -> list:
    """Greedy requests, one with logprobs and one seeded sampled request (whose draws must not be disturbed)."""
    ps = prompts(4, seed=7)
    return [
        request("g0", ps[0], greedy(MAX_NEW)),
        request("g1", ps[1], greedy(MAX_NEW, logprobs=2)),
        request("g2", ps[2], greedy(MAX_NEW, min_new_tokens=3, stop_token_ids=[5])),
        request("s3", ps[3], SEEDED),
    ]


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    """Reference: each clean request run alone."""
    sched = make_scheduler(tiny_model_dir)
    refs = {}
    for recv in clean_requests():
        refs[recv.rid] = drive(sched, {0: [recv]})[recv.rid].output_ids
        sched.flush_cache()
    return refs


def poisoned(**fields) -> SamplingParams:
    """Greedy parameters with fields set as a client could smuggle them past construction."""
    params = greedy(MAX_NEW)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


POISONS = {
    "seed-2**64": poisoned(seed=2**64),
    "seed-below-int64": poisoned(seed=-(2**63) - 1),
    "seed-str": poisoned(seed="abc"),
    "seed-float": poisoned(seed=1.5),
    "stop-token-2**63-min-new": poisoned(stop_token_ids=[2**63], min_new_tokens=2),
    "stop-token-str-min-new": poisoned(stop_token_ids=["x"], min_new_tokens=2),
    "logprobs-bool": poisoned(logprobs=True),
    "logprobs-float": poisoned(logprobs=1.5),
    "top-k-float": dataclasses.replace(poisoned(top_k=2.5), temperature=1.0),
    "stop-token-ids-int": poisoned(stop_token_ids=7),  # raises in the stop check, not in sampling
    "max-new-tokens-str": poisoned(max_new_tokens="10"),
}


def run_with_poison(sched: Scheduler, poison: SamplingParams, arrival_step: int, caplog):
    bad = request("poison", prompts(1, seed=99)[0], poison)
    arrivals = {0: clean_requests()}
    arrivals.setdefault(arrival_step, []).append(bad)
    with caplog.at_level(logging.ERROR):
        res = drive(sched, arrivals)
    return res, [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("arrival_step", [0, 3], ids=["same-batch", "mid-decode"])
@pytest.mark.parametrize("name", sorted(POISONS))
def test_a_poisoned_request_fails_alone(tiny_model_dir, alone, caplog, name, arrival_step):
    sched = make_scheduler(tiny_model_dir)
    res, errors = run_with_poison(sched, POISONS[name], arrival_step, caplog)

    assert res["poison"].finish.type == "error"
    assert res["poison"].finish.message
    for rid, ref in alone.items():
        assert res[rid].output_ids == ref, rid
        assert res[rid].finish.type == "length", rid
    assert len(errors) == 1 and "poison" in errors[0].getMessage()
    assert_pool_whole(sched)
    assert sched.live == {}


def test_an_injected_fault_fails_that_request_mid_decode(tiny_model_dir, alone, caplog, monkeypatch):
    monkeypatch.setenv(fault_isolation.TEST_FAULT_ENV, "poison")
    sched = make_scheduler(tiny_model_dir)
    res, errors = run_with_poison(sched, greedy(MAX_NEW), 0, caplog)

    assert res["poison"].finish.type == "error"
    assert "injected" in res["poison"].finish.message
    assert len(res["poison"].output_ids) == fault_isolation.TEST_FAULT_DECODE_STEP
    for rid, ref in alone.items():
        assert res[rid].output_ids == ref, rid
    assert len(errors) == 1 and "poison" in errors[0].getMessage()
    assert_pool_whole(sched)


def test_the_fault_hook_is_off_by_default(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(fault_isolation.TEST_FAULT_ENV, raising=False)
    sched = make_scheduler(tiny_model_dir)
    res = drive(sched, {0: [request("poison", prompts(1)[0], greedy(MAX_NEW))]})
    assert res["poison"].finish.type == "length"


@pytest.mark.parametrize("ids", [[-1, 20, 30], [20, 10**9], [20, 2**70]], ids=["negative", "oov", "huge"])
def test_prompt_token_ids_outside_the_vocabulary_are_refused(tiny_model_dir, ids):
    sched = make_scheduler(tiny_model_dir)
    res = drive(sched, {0: [request("bad", ids, greedy(4))]})
    assert res["bad"].finish.type == "error" and res["bad"].output_ids == []
    assert_pool_whole(sched)


def test_a_duplicate_rid_is_refused_and_the_original_runs_on(tiny_model_dir, alone, caplog):
    sched = make_scheduler(tiny_model_dir)
    original = clean_requests()[0]
    sched.add_request(original)
    outputs, finishes = [], []
    for step in range(MAX_NEW + 5):
        if step == 2:
            with caplog.at_level(logging.ERROR):
                sched.add_request(request(original.rid, prompts(1, seed=3)[0], greedy(4)))
        out = sched.step()
        for i, rid in enumerate(out.rids if out else []):
            assert rid == original.rid
            if out.finished_reasons[i] is not None and out.finished_reasons[i].type == "error":
                finishes.append(out.finished_reasons[i])
                continue
            outputs.extend(out.output_ids[i])
            if out.finished_reasons[i] is not None:
                finishes.append(out.finished_reasons[i])
    assert [f.type for f in finishes] == ["error", "length"]
    assert outputs == alone[original.rid]
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    assert_pool_whole(sched)
    assert sched.live == {}


def test_out_of_memory_while_sampling_is_not_isolated(tiny_model_dir, monkeypatch):
    sched = make_scheduler(tiny_model_dir)

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(sched.sampler.sampler, "sample", no_memory)
    sched.add_request(clean_requests()[0])
    with pytest.raises(MemoryError):
        sched.step()


def test_rows_that_survive_a_failed_batch_keep_their_random_draws():
    """A batch that raises is retried row by row; the sampler raises for a request's parameters before it
    draws, so a seeded row's token is the one it gets alone."""
    import torch

    from srt.sampling.sampler import Sampler, make_generator
    from srt.scheduler.schedule_batch import Req

    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    default = torch.Generator().manual_seed(0)

    def req(rid: str, **fields) -> Req:
        params = SamplingParams(temperature=1.0, **fields)
        return Req(rid, [1, 2], params, generator=make_generator(params.seed, default))

    sampler = IsolatingSampler(Sampler(vocab, eos_token_ids=[0]))
    alone = [sampler.sample(logits[i : i + 1], [req(f"s{i}", seed=10 + i)]).next_token_ids[0] for i in (0, 2)]
    bad = req("bad", seed=5)
    bad.sampling_params.logprobs = True  # a bool as the top-logprobs count: topk() raises
    reqs = [req("s0", seed=10), bad, req("s2", seed=12)]
    out = sampler.sample(logits, reqs)

    assert bad.finished_reason.type == "error"
    assert [out.next_token_ids[0], out.next_token_ids[2]] == alone


def test_a_request_without_sampling_parameters_is_refused(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir)
    res = drive(sched, {0: [request("bad", [20, 30], None), request("g0", [20, 30], greedy(3))]})
    assert res["bad"].finish.type == "error"
    assert res["g0"].finish.type == "length" and len(res["g0"].output_ids) == 3
    assert_pool_whole(sched)
