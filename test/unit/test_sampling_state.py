"""State the decode step keeps instead of rebuilding it each step: penalty counts kept incrementally equal the
from-scratch computation, sampling-parameter tensors are built exactly when the batch changes, and the KV
free list stays a correct FIFO free list under any interleaving of alloc and free."""

from __future__ import annotations

import random
from collections import deque

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.mem_cache.memory_pool import PADDING_SLOT, TokenToKVPoolAllocator
from srt.sampling.penalties import BatchPenalties, PenaltyPool, apply_penalties
from srt.sampling.sampler import Sampler
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.schedule_batch import Req
from srt.scheduler.step_sampler import IsolatingSampler
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import assert_pool_whole, make_scheduler, prompts

VOCAB = 40


def random_params(rng: random.Random) -> SamplingParams:
    kinds = rng.sample(["repetition_penalty", "frequency_penalty", "presence_penalty", None], k=2)
    values = {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": -0.4}
    return SamplingParams(temperature=0.0, **{k: values[k] for k in kinds if k is not None})


def test_incremental_penalties_equal_the_from_scratch_computation():
    """Random requests join, decode, get retracted (row released, rebuilt from their context on return)
    and finish; every step the incremental rows give exactly the from-scratch logits."""
    rng = random.Random(0)
    pool = PenaltyPool(VOCAB)
    waiting = [
        Req(f"r{i}", [rng.randrange(-2, VOCAB + 3) for _ in range(rng.randint(1, 30))], random_params(rng))
        for i in range(12)
    ]
    running: list[Req] = []
    penalties = None
    for _step in range(200):
        changed = False
        if waiting and (not running or rng.random() < 0.2):
            running.append(waiting.pop(0))
            changed = True
        if running and rng.random() < 0.1:  # retraction or finish: the row goes back to the pool
            req = running.pop(rng.randrange(len(running)))
            if req.penalty_row is not None:  # it may leave before its first step
                pool.release(req.penalty_row)
                req.penalty_row = None
            if rng.random() < 0.5:
                waiting.append(req)  # resumes later with its output so far
            changed = True
        if not running:
            continue
        if changed or penalties is None:
            penalties = BatchPenalties.build(pool, running)
        logits = torch.randn(len(running), VOCAB, generator=torch.Generator().manual_seed(_step))
        incremental, scratch = logits.clone(), logits.clone()
        if penalties is not None:
            penalties.apply(incremental)
        apply_penalties(
            scratch,
            [r.sampling_params for r in running],
            [r.origin_input_ids for r in running],
            [r.output_ids for r in running],
        )
        assert torch.equal(incremental, scratch)
        next_ids = torch.tensor([rng.randrange(VOCAB) for _ in running])
        if penalties is not None:
            penalties.record(next_ids)
        for req, token in zip(running, next_ids.tolist(), strict=True):
            req.output_ids.append(token)
    assert pool.capacity > 0


def test_sampling_batch_is_built_when_the_batch_changes_and_only_then():
    sampler = IsolatingSampler(Sampler(VOCAB, eos_token_ids=[2]))
    reqs = [Req(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.5, top_p=0.9, seed=i)) for i in range(3)]
    for r in reqs:
        r.generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB)
    for _ in range(5):
        sampler.sample(logits, list(reqs))  # a new list with the same requests: the steady decode batch
    assert sampler.num_batch_builds == 1
    sampler.sample(logits[:2], reqs[:2])  # one finished
    sampler.sample(logits[:2], reqs[:2])
    assert sampler.num_batch_builds == 2
    sampler.sample(logits[:2], [reqs[1], reqs[0]])  # same requests, another order: another batch
    assert sampler.num_batch_builds == 3


def test_scheduler_builds_sampling_tensors_per_batch_not_per_step(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir)
    ps = prompts(3, seed=21)
    same_length = [request(f"r{i}", p, greedy(10, frequency_penalty=0.5)) for i, p in enumerate(ps)]
    drive(sched, {0: same_length})
    assert sched.sampler.num_batch_builds == 1  # one prefill then nine decode steps of the same batch
    builds = sched.sampler.num_batch_builds
    drive(sched, {0: [request("a", ps[0], greedy(10)), request("b", ps[1], greedy(4))]})
    assert sched.sampler.num_batch_builds - builds == 2  # b finishing changes the batch once


def test_penalized_requests_batched_and_retracted_match_running_alone(tiny_model_dir):
    """The scheduler keeps penalty rows across steps, releases them on retraction and rebuilds them from
    the context on resumption: outputs equal each request run alone, and no row leaks."""
    ps = prompts(6, low=30, high=30, seed=17)
    kinds = [
        dict(frequency_penalty=0.8),
        dict(presence_penalty=0.6),
        dict(repetition_penalty=1.5),
        dict(frequency_penalty=0.3, repetition_penalty=1.2),
        dict(),
        dict(presence_penalty=-0.5, frequency_penalty=0.2),
    ]
    alone_sched = make_scheduler(tiny_model_dir)
    alone = {
        f"r{i}": drive(alone_sched, {0: [request(f"r{i}", p, greedy(30, **kinds[i]))]})[f"r{i}"].output_ids
        for i, p in enumerate(ps)
    }
    sched = make_scheduler(tiny_model_dir, max_total_tokens=230, enable_mixed_chunk=True)
    res = drive(
        sched,
        {
            0: [request(f"r{i}", p, greedy(30, **kinds[i])) for i, p in enumerate(ps[:3])],
            2: [request(f"r{i}", p, greedy(30, **kinds[i])) for i, p in enumerate(ps) if i >= 3],
        },
    )
    assert sum(r.num_retractions for r in res.values()) > 0
    assert {rid: r.output_ids for rid, r in res.items()} == alone
    pool = sched.sampler.sampler.penalty_pool
    assert pool.num_free() == pool.capacity
    assert_pool_whole(sched)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9), st.randoms(use_true_random=False)), max_size=80))
def test_kv_free_list_is_a_fifo_of_free_slots_under_any_interleaving(ops):
    size = 24
    allocator = TokenToKVPoolAllocator(size)
    model = deque(range(PADDING_SLOT + 1, size + 1))  # free slots in the order they come back
    live: list[int] = []
    for is_alloc, n, rng in ops:
        if is_alloc:
            got = allocator.alloc(n)
            if n > len(model):
                assert got is None
            else:
                assert got.tolist() == [model.popleft() for _ in range(n)]
                live.extend(got.tolist())
        elif live:
            rng.shuffle(live)
            freed, live = live[: min(n, len(live))], live[min(n, len(live)) :]
            table = torch.tensor(freed)  # a caller may overwrite what it freed: the allocator copied it
            allocator.free(table)
            table.fill_(PADDING_SLOT)
            model.extend(freed)
        assert allocator.available_size() == len(model) == size - len(live)
    assert sorted(allocator.alloc(len(model)).tolist()) == sorted(model)
