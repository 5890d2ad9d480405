"""A long prompt mid-chunk and the requests that arrive during its prefill, counted in tokens and steps (no
timing): the step's prefill budget is what it is for the long prompt alone, the arrivals share it, each is
admitted in the step after it arrives, and the long prompt keeps at least LONG_PROMPT_MIN_SHARE of the
tokens its steps offered it (its ledger), so it finishes in about the steps it takes alone, while the
arrivals spend its surplus first (srt/scheduler/prefill_admission.py)."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest

from srt.scheduler.mixed_chunk import LONE_PREFILL_STEP_SECONDS, MIN_MIXED_PREFILL_TOKENS, MixedChunkBudget
from srt.scheduler.prefill_admission import LONG_PROMPT_MIN_SHARE
from srt.scheduler.scheduler import Scheduler
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import assert_pool_whole, make_scheduler, mixing, prompts

LONG_LEN = 1800
# The step budget the cost model gives a prefill step of its own (LONE_PREFILL_STEP_SECONDS / b): small
# against the prompt, so that it takes many steps.
STEP_TOKENS = 150
# A light load, as in a chat server: a few short prompts arriving during the long prefill, two at once once.
ARRIVAL_STEPS = (1, 3, 4, 4, 6, 8, 9)
SHORT_NEW_TOKENS = 3
# The long prompt's steps with these arrivals, against its steps alone: their prompts and decode rows take
# their share of the steps' budget (docs/cpu_execution.md's target for its time, counted in steps).
MAX_STEP_RATIO = 1.2


def with_step_budget(sched: Scheduler, tokens: int) -> Scheduler:
    """Fix the cost model where a prefill step of its own carries `tokens` tokens (t = b x tokens, a = 0), and
    stop feeding it, so that the test counts tokens, not times. The mixed budget this makes is the 32-token
    floor: the rule that shrank a long prompt to it is what the tests below would catch."""
    budget: MixedChunkBudget = sched.mixed_budget
    budget.fixed_seconds, budget.token_seconds = 0.0, LONE_PREFILL_STEP_SECONDS / tokens
    budget.adaptive = False
    return sched


def run_long_prompt(sched: Scheduler, shorts: list[list[int]]) -> dict:
    """Drive the long prompt (at step 0) and `shorts` (at ARRIVAL_STEPS): per step, the decoding requests
    before it and each request's prefilled tokens in it."""
    long_prompt = prompts(1, low=LONG_LEN, high=LONG_LEN, seed=21)[0]
    arrivals = {0: [request("long", long_prompt, greedy(2))]}
    for i, (at, p) in enumerate(zip(ARRIVAL_STEPS, shorts, strict=False)):
        arrivals.setdefault(at, []).append(request(f"s{i}", p, greedy(SHORT_NEW_TOKENS)))
    lengths = {r.rid: len(r.input_ids) for reqs in arrivals.values() for r in reqs}
    done = dict.fromkeys(lengths, 0)  # prompt tokens prefilled so far
    trace = {"decoding": [], "prefilled": []}
    step = sched.step

    def counted_step():
        trace["decoding"].append(len(sched.running))
        return step()

    def record(_, s):
        now = {rid: min(r.kv_len, lengths[rid]) for rid, r in s.live.items() if rid in lengths}
        trace["prefilled"].append({rid: n - done[rid] for rid, n in now.items() if n > done[rid]})
        done.update(now)

    sched.step = counted_step
    trace["results"] = drive(sched, arrivals, on_step=record)
    trace["long_steps"] = 1 + max(i for i, step in enumerate(trace["prefilled"]) if "long" in step)
    return trace


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "unmixed"])
def test_a_long_prompt_keeps_its_chunk_and_arrivals_go_in_the_next_step(tiny_model_dir, mixed):
    shorts = prompts(len(ARRIVAL_STEPS), low=6, high=14, seed=22)
    if mixed:  # the CPU default: the cost model's budget, decode rows riding along
        sched = with_step_budget(make_scheduler(tiny_model_dir, chunked_prefill_size=4096), STEP_TOKENS)
        alone = with_step_budget(make_scheduler(tiny_model_dir, chunked_prefill_size=4096), STEP_TOKENS)
    else:  # no cost model (a GPU's default): the chunk size is the step's budget
        sched = make_scheduler(tiny_model_dir, chunked_prefill_size=STEP_TOKENS, **mixing(False))
        alone = make_scheduler(tiny_model_dir, chunked_prefill_size=STEP_TOKENS, **mixing(False))
    shared = run_long_prompt(sched, shorts)
    solo = run_long_prompt(alone, [])
    assert solo["long_steps"] == math.ceil(LONG_LEN / STEP_TOKENS)

    offered = taken = 0
    for i, (decoding, step) in enumerate(zip(shared["decoding"], shared["prefilled"], strict=True)):
        budget = STEP_TOKENS - decoding if mixed else STEP_TOKENS  # decode rows share a mixed step's second
        assert sum(step.values()) <= budget, f"step {i} carried {step} over its budget {budget}"
        if "long" in step and i < shared["long_steps"] - 1:  # the last chunk is what is left of the prompt
            offered, taken = offered + budget, taken + step["long"]
            assert taken >= LONG_PROMPT_MIN_SHARE * offered, f"step {i}: {step}, {taken} of {offered} so far"
    # the first arrival finds the long prompt's surplus (its first chunk, taken whole): it goes ahead, and
    # where steps are bounded in time the chunk beside it is the smallest, so the step it waits for is its
    # own prefill, not a full step (on a chunk-size budget, a GPU's, the chunk takes the rest)
    first_arrival = shared["prefilled"][ARRIVAL_STEPS[0]]
    assert "s0" in first_arrival
    if mixed:
        assert first_arrival["long"] == MIN_MIXED_PREFILL_TOKENS, first_arrival
    # each arrival is prefilled in the step it arrives before (unmixed, a decode step may come first)
    for i, at in enumerate(ARRIVAL_STEPS):
        admitted = next(k for k, step in enumerate(shared["prefilled"]) if f"s{i}" in step)
        assert admitted - at <= (0 if mixed else 1), f"s{i} arrived before step {at}, admitted in {admitted}"
        assert shared["results"][f"s{i}"].first_token_ts < shared["results"]["long"].first_token_ts
    # the long prompt finishes in about its steps alone (unmixed, decode steps alternate with its chunks)
    if mixed:  # its time, in steps of the budget (a = 0: a step costs its tokens, decode rows included)
        spent = shared["prefilled"][: shared["long_steps"]], shared["decoding"][: shared["long_steps"]]
        units = (
            sum(sum(step.values()) + decoding for step, decoding in zip(*spent, strict=True)) / STEP_TOKENS
        )
        assert units <= MAX_STEP_RATIO * solo["long_steps"]
    else:
        prefill_steps = sum("long" in step for step in shared["prefilled"])
        assert prefill_steps <= MAX_STEP_RATIO * solo["long_steps"]
    assert shared["results"]["long"].output_ids == solo["results"]["long"].output_ids
    assert_pool_whole(sched)


def test_a_queue_of_arrivals_never_takes_more_than_its_share_of_the_step(tiny_model_dir):
    """Many prompts arriving at once go ahead of the long prompt as far as its surplus allows, then share each
    step with it: over its steps the long prompt still takes at least LONG_PROMPT_MIN_SHARE of the tokens
    offered to it, and the queue drains in order."""
    # no prefix cache: a cached first token would make a prompt shorter than the 25 tokens counted below
    sched = make_scheduler(tiny_model_dir, chunked_prefill_size=4096, disable_radix_cache=True)
    sched = with_step_budget(sched, STEP_TOKENS)
    burst = [request(f"b{i}", p, greedy(1)) for i, p in enumerate(prompts(12, low=25, high=25, seed=23))]
    long_prompt = prompts(1, low=600, high=600, seed=24)[0]
    steps = []

    def record(_, s):
        steps.append((s.chunked_req.kv_len if s.chunked_req is not None else None, len(s.waiting)))

    drive(sched, {0: [request("long", long_prompt, greedy(1))], 1: burst}, on_step=record)
    # 12 prompts of 25 tokens after a first chunk of 150 (the long prompt's ledger: 150 taken of 150 offered).
    # Step 1: nothing owed, 4 prompts beside the smallest chunk (182 of 300); step 2: 43 owed (half of 450
    # less 182), 4 prompts beside it (225 of 450); step 3: 75 owed, 3 prompts (300 of 600); step 4: the last.
    assert [waiting for _, waiting in steps[1:5]] == [8, 4, 1, 0]
    kv = [kv_len for kv_len, _ in steps[:5]]
    assert [b - a for a, b in pairwise(kv)][:3] == [MIN_MIXED_PREFILL_TOKENS, 43, 75]
    for k in range(1, 5):  # what it took over its first k + 1 steps against what they offered
        assert kv[k] >= LONG_PROMPT_MIN_SHARE * STEP_TOKENS * (k + 1), (k, kv)
    assert_pool_whole(sched)


def test_a_chunk_that_finishes_its_prompt_beside_arrivals_is_never_cut(tiny_model_dir):
    """The chunk beside arrivals falls to its floor only while the prompt would not finish in the step anyway:
    a last chunk that fits what the arrivals leave is taken whole (cutting it would only add a step)."""
    sched = make_scheduler(tiny_model_dir, chunked_prefill_size=4096, disable_radix_cache=True)
    sched = with_step_budget(sched, STEP_TOKENS)
    long_prompt = prompts(1, low=STEP_TOKENS + 50, high=STEP_TOKENS + 50, seed=25)[0]
    arrival = request("short", prompts(1, low=25, high=25, seed=26)[0], greedy(1))
    steps = []

    def record(_, s):
        steps.append((s.chunked_req is not None, {r.rid: r.kv_len for r in s.live.values()}))

    drive(sched, {0: [request("long", long_prompt, greedy(1))], 1: [arrival]}, on_step=record)
    assert steps[0][0]  # the first chunk of 150 left the prompt mid-chunk
    assert not steps[1][0], "the last 50 tokens were cut beside a 25-token arrival"
    assert_pool_whole(sched)


def test_a_long_prompts_last_chunk_beside_an_arrival_is_its_floor(tiny_model_dir):
    """A prompt that needed more than whole steps stays long to its end: its last chunk, deep into its context,
    falls to its floor beside an arrival like the chunks before it, so the arrival's step is its own prefill
    and a small chunk; the rest follows in the next step."""
    sched = make_scheduler(tiny_model_dir, chunked_prefill_size=4096, disable_radix_cache=True)
    sched = with_step_budget(sched, STEP_TOKENS)
    length = 3 * STEP_TOKENS + 75
    arrival = request("short", prompts(1, low=25, high=25, seed=27)[0], greedy(2))  # live after its prefill
    steps = []

    def record(_, s):
        steps.append({r.rid: r.kv_len for r in s.live.values()})

    long_prompt = prompts(1, low=length, high=length, seed=28)[0]
    res = drive(sched, {0: [request("long", long_prompt, greedy(1))], 3: [arrival]}, on_step=record)
    assert [steps[k]["long"] for k in range(3)] == [STEP_TOKENS, 2 * STEP_TOKENS, 3 * STEP_TOKENS]
    assert steps[3]["long"] == 3 * STEP_TOKENS + MIN_MIXED_PREFILL_TOKENS  # beside the arrival's prefill
    assert steps[3]["short"] == 25
    assert "long" not in steps[4] and len(res["long"].output_ids) == 1  # the rest, in the next step
    assert res["long"].first_token_ts > res["short"].first_token_ts
    assert_pool_whole(sched)
