"""Speculative decoding in the scheduler (docs/speculative_decoding.md), on a tiny random Llama with NGRAM
drafts: greedy requests produce exactly the tokens they produce without speculation (alone, batched, mixed or
not, under retraction, fp32 and int8) while drafts really are accepted; rejected drafts leave no KV slot
behind and never reach the prefix cache; stop conditions act at each accepted position; and the per-request
figures add up to the step totals the counters are fed."""

from __future__ import annotations

import random

import pytest
import torch

from srt.io_struct import AbortReq
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.mixed_chunk import MixedChunkBudget
from srt.scheduler.schedule_batch import Req
from srt.scheduler.schedule_policy import MIN_NEW_TOKEN_RATIO
from srt.scheduler.scheduler import Scheduler
from srt.scheduler.spec_step import may_speculate
from srt.scheduler.step_hooks import StepReporter
from srt.scheduler.token_append import append_token_runs
from srt.server_args import ServerArgs
from srt.speculative.proposer import Drafts, Proposer
from srt.speculative.stats import SpecStepStats
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import (  # noqa: F401 (private_int8_cache: the module's autouse fixture)
    QUANTIZATIONS,
    VOCAB_HIGH,
    VOCAB_LOW,
    assert_pool_whole,
    private_int8_cache,
    prompts,
)

# 5 positions per verify step: the fed token and up to 4 drafts
# a 1-token match anchors a lookup (SGLang's minimum; srt's default is 3): the random tiny model's sampled
# continuations then draft too
SPEC = {
    "speculative_algorithm": "NGRAM",
    "speculative_num_draft_tokens": 5,
    "speculative_ngram_min_match_window_size": 1,
}
DRAFTS_PER_STEP = 4
MAX_NEW = 24


class StepTotals(StepReporter):
    """Keeps every verify step's totals, as the metrics collector receives them, and each decode step's draft
    budget."""

    def __init__(self) -> None:
        self.steps: list[SpecStepStats] = []
        self.budgets: list[int] = []

    def on_verify(self, step: SpecStepStats) -> None:
        self.steps.append(step)

    def on_draft_budget(self, drafts_per_request: int) -> None:
        self.budgets.append(drafts_per_request)

    @property
    def accepted(self) -> int:
        return sum(s.num_accepted_tokens for s in self.steps)


TEST_STEP_TOKENS = 64


def make(model_dir: str, quant: str = "none", spec: bool = True, **overrides) -> tuple[Scheduler, StepTotals]:
    args = ServerArgs(
        **{
            "max_total_tokens": 4096,
            "max_running_requests": 16,
            "quantization": quant,
            **(SPEC if spec else {}),
            **overrides,
        }
    )
    runner = ModelRunner(
        model_dir,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        quantization=args.quantization,
    )
    totals = StepTotals()
    sched = Scheduler(args, runner, reporter=totals)
    # these tests drive batches of up to 16 requests and need them to draft: a step budget that lets them,
    # rather than the CPU's default (spec_step.verify_step_tokens, test_speculative_flags.py), which stops at 9
    sched.spec.step_tokens = TEST_STEP_TOKENS
    return sched, totals


def grounded_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (a quoted or edited document): lookups find matches in them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(4, 10))]
        out.append(phrase * rng.randint(2, 4) + phrase[: rng.randint(0, len(phrase) - 1)])
    return out


WORKLOAD = grounded_prompts(8) + prompts(4, seed=1)
RIDS = [f"r{i}" for i in range(len(WORKLOAD))]


def requests(max_new: int = MAX_NEW, **kw):
    return [request(rid, p, greedy(max_new, **kw)) for rid, p in zip(RIDS, WORKLOAD, strict=True)]


def run_alone(sched: Scheduler, reqs) -> dict[str, list[int]]:
    return {r.rid: drive(sched, {0: [r]})[r.rid].output_ids for r in reqs}


def cached_paths(sched: Scheduler) -> list[list[int]]:
    """Every root-to-leaf token path of the radix cache."""
    paths = []

    def walk(node, prefix: list[int]) -> None:
        if not node.children:
            paths.append(prefix)
        for child in node.children.values():
            walk(child, prefix + child.key)

    walk(sched.tree_cache.root, [])
    return paths


def assert_cache_holds_only_output(sched: Scheduler, outputs: dict[str, list[int]]) -> None:
    """A rejected draft differs from the token the request output at its position: a cached path holding one
    would be a prefix of no request's tokens."""
    sequences = [p + outputs[rid] for rid, p in zip(RIDS, WORKLOAD, strict=True)]
    for path in cached_paths(sched):
        assert any(seq[: len(path)] == path for seq in sequences), path


def assert_every_slot_accounted(step: int, sched: Scheduler) -> None:
    """After every step each KV slot is free, in the prefix cache, or one of a running request's own slots
    (positions prefix_len..kv_len): a rejected draft's slot left allocated would be none of these."""
    holders = [*sched.running, *([sched.chunked_req] if sched.chunked_req else [])]
    own = sum(r.kv_len - r.prefix_len for r in holders)
    cached = sched.tree_cache.evictable_size() + sched.tree_cache.protected_size()
    assert sched.allocator.available_size() + cached + own == sched.allocator.size, step


@pytest.fixture(scope="module", params=QUANTIZATIONS)
def quant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(tiny_model_dir, quant) -> dict[str, list[int]]:
    """Each request alone, without speculation."""
    sched, _ = make(tiny_model_dir, quant, spec=False)
    return run_alone(sched, requests())


def test_greedy_output_is_the_same_with_ngram_speculation_alone(tiny_model_dir, quant, reference):
    sched, totals = make(tiny_model_dir, quant)
    assert run_alone(sched, requests()) == reference
    assert totals.accepted > 0, "no draft was accepted: the equality above says nothing about verification"
    assert_pool_whole(sched)
    assert_cache_holds_only_output(sched, reference)
    assert len(sched.spec.proposer.histories) == 0  # every finished request released its proposer state


@pytest.mark.parametrize("mixed", [False, True], ids=["unmixed", "mixed"])
def test_greedy_output_is_the_same_with_ngram_speculation_batched(tiny_model_dir, quant, reference, mixed):
    """Arrivals while others decode: with mixed steps the running requests draft and verify next to the
    prefill; the steps after verify several requests at once."""
    sched, totals = make(
        tiny_model_dir, quant, **({"enable_mixed_chunk": True} if mixed else {"disable_mixed_chunk": True})
    )
    sched.spec.step_tokens = 4096  # room for drafts next to these prompts' prefill (the next test: without)
    verify = sched.builder.verify
    with_prefill = []

    def recording(reqs, drafts, plain, prefill=None):
        with_prefill.append(bool(prefill))
        return verify(reqs, drafts, plain, prefill)

    sched.builder.verify = recording
    reqs = requests()
    res = drive(sched, {0: reqs[:6], 2: reqs[6:9], 5: reqs[9:]}, on_step=assert_every_slot_accounted)
    assert any(with_prefill) == mixed  # with mixed steps, drafts are verified next to a prefill too
    assert {rid: c.output_ids for rid, c in res.items()} == reference
    assert totals.accepted > 0
    assert any(s.num_drafts > 1 for s in totals.steps), "no verify step judged several requests"
    assert all(len(c.output_ids) == MAX_NEW and c.finish.type == "length" for c in res.values())
    assert_pool_whole(sched)
    assert_cache_holds_only_output(sched, reference)


def test_verify_steps_laid_out_as_decode_rows_give_the_same_tokens(tiny_model_dir, quant, reference):
    """What a runner with decode CUDA graphs gets (`StepBuilder.verify_rows_as_decode`): each fed token a
    decode row of its own over its request's slots up to its position. Batched arrivals and mixed steps, so
    rows of several requests share a step, and a step with a prefill keeps the extend layout."""
    sched, totals = make(tiny_model_dir, quant, enable_mixed_chunk=True)
    sched.builder.verify_rows_as_decode = TEST_STEP_TOKENS
    verify = sched.builder.verify
    layouts = []

    def recording(reqs, drafts, plain, prefill=None):
        batch = verify(reqs, drafts, plain, prefill)
        layouts.append((batch.is_decode, bool(prefill), batch.batch_size))
        return batch

    sched.builder.verify = recording
    reqs = requests()
    res = drive(sched, {0: reqs[:6], 2: reqs[6:9], 5: reqs[9:]}, on_step=assert_every_slot_accounted)
    assert {rid: c.output_ids for rid, c in res.items()} == reference
    assert totals.accepted > 0
    as_rows = [bs for is_decode, _, bs in layouts if is_decode]
    assert max(as_rows) > 1 + DRAFTS_PER_STEP, "no decode-row step held rows of several requests"
    assert all(not is_decode for is_decode, prefill, _ in layouts if prefill)
    assert_pool_whole(sched)
    assert_cache_holds_only_output(sched, reference)


def test_a_prefill_chunk_counts_against_the_verify_step_budget(tiny_model_dir):
    """Next to a prefill chunk a CPU step is bound by computing, where a rejected draft costs as much as a
    prompt token: a mixed step's prefill tokens, drafts and newest tokens together stay within the budget,
    so a chunk that fills it leaves the running requests decoding plainly, with the same output."""
    sched, totals = make(tiny_model_dir, enable_mixed_chunk=True)
    sched.spec.step_tokens = 48
    verify = sched.builder.verify
    fed_with_prefill = []

    def recording(reqs, drafts, plain, prefill=None):
        if prefill:
            fed = sum(r.extend_len for r in prefill) + len(reqs) + len(plain) + sum(len(d) for d in drafts)
            fed_with_prefill.append(fed)
        return verify(reqs, drafts, plain, prefill)

    sched.builder.verify = recording
    mixed_steps = []
    extend = sched.builder.extend

    def counting(reqs, decode, **fields):
        if decode:
            mixed_steps.append(sum(r.extend_len for r in reqs))
        return extend(reqs, decode, **fields)

    sched.builder.extend = counting
    reqs = requests()
    res = drive(sched, {0: reqs[:6], 2: reqs[6:9], 5: reqs[9:]})
    assert all(fed <= sched.spec.step_tokens for fed in fed_with_prefill)
    assert any(tokens >= sched.spec.step_tokens for tokens in mixed_steps), "no chunk filled the budget"
    assert totals.accepted > 0
    assert all(len(c.output_ids) == MAX_NEW and c.finish.type == "length" for c in res.values())
    assert_pool_whole(sched)


def test_retraction_with_speculation_resumes_with_identical_output(tiny_model_dir):
    """8 requests of 30 prompt + 40 output tokens in a 300-slot pool, admitted under the least reservation
    ratio (speculation needs fewer decode steps, so the ratio would not decay far enough to overcommit): requests
    are retracted and resumed while verify steps take extra slots, and the tokens are those of each request
    alone without speculation."""
    ps = prompts(8, low=30, high=30, seed=7)
    reqs = [request(f"q{i}", p, greedy(40)) for i, p in enumerate(ps)]
    plain, _ = make(tiny_model_dir, spec=False)
    refs = run_alone(plain, reqs)
    sched, totals = make(tiny_model_dir, max_total_tokens=300)
    sched.new_token_ratio = MIN_NEW_TOKEN_RATIO
    res = drive(sched, {0: reqs[:4], 3: reqs[4:]}, on_step=assert_every_slot_accounted)
    assert sum(c.num_retractions for c in res.values()) > 0
    assert totals.accepted > 0
    assert {rid: c.output_ids for rid, c in res.items()} == refs
    assert_pool_whole(sched)


def test_chunked_prefill_alternates_with_verify_steps(tiny_model_dir):
    """Without mixed steps, a long prompt's chunks alternate with the running requests' verify steps; every
    output is what it is alone without speculation."""
    long_prompt = (grounded_prompts(1, seed=5)[0] * 40)[:150]
    reqs = [request("long", long_prompt, greedy(MAX_NEW)), *requests()[:3]]
    plain, _ = make(tiny_model_dir, spec=False)
    refs = run_alone(plain, reqs)
    sched, totals = make(tiny_model_dir, chunked_prefill_size=32, disable_mixed_chunk=True)
    verified_mid_chunk = []  # per step: a verify step ran while the long prompt was part-way prefilled
    verify_steps = [0]

    def check(step: int, s: Scheduler) -> None:
        assert_every_slot_accounted(step, s)
        verified_mid_chunk.append(s.chunked_req is not None and len(totals.steps) > verify_steps[0])
        verify_steps[0] = len(totals.steps)

    res = drive(sched, {0: reqs[1:], 2: reqs[:1]}, on_step=check)
    assert {rid: c.output_ids for rid, c in res.items()} == refs
    assert any(verified_mid_chunk) and totals.accepted > 0
    assert_pool_whole(sched)


def test_aborts_during_speculation_free_everything(tiny_model_dir):
    sched, totals = make(tiny_model_dir, max_running_requests=4)
    for r in requests(max_new=60):
        sched.add_request(r)
    for _ in range(8):
        sched.step()
    assert totals.steps, "no verify step ran"
    assert sched.running and sched.waiting
    sched.abort_request(AbortReq(rid=sched.running[0].rid))
    sched.step()
    sched.abort_request(AbortReq(rid=""))
    out = sched.step()
    assert out is not None and all(f.type == "abort" for f in out.finished_reasons)
    assert_pool_whole(sched)
    assert len(sched.spec.proposer.histories) == 0


def test_max_tokens_is_never_exceeded(tiny_model_dir, quant, reference):
    """Short budgets with up to 4 drafts a step: a request drafts at most max_tokens - 1 - (its output) tokens,
    so it ends with exactly max_tokens tokens, those of the run without speculation."""
    sched, totals = make(tiny_model_dir, quant)
    whole_prefill_in_one_step(sched)
    budgets = {rid: 2 + i % 7 for i, rid in enumerate(RIDS)}
    reqs = [request(rid, p, greedy(budgets[rid])) for rid, p in zip(RIDS, WORKLOAD, strict=True)]
    res = drive(sched, {0: reqs})
    for rid, c in res.items():
        assert c.output_ids == reference[rid][: budgets[rid]], rid
        assert c.finish.type == "length"
    assert totals.accepted > 0
    assert_pool_whole(sched)
    # every draft accepted: a verify step takes up to 5 tokens and leaves its request at least one (a step
    # gives the accepted drafts plus one more), so a request whose prefill left 5m + 1 tokens ends on a plain
    # decode step, every other one on a verify step that fills its budget exactly
    sched, _ = make(tiny_model_dir, quant)
    whole_prefill_in_one_step(sched)
    sched.spec.proposer = Oracle(reference)
    seen = capture_runs(sched)
    res = drive(sched, {0: reqs})
    assert {rid: c.output_ids for rid, c in res.items()} == {
        rid: reference[rid][: budgets[rid]] for rid in RIDS
    }
    assert all(start + len(run) <= budgets[rid] for rid, start, run in seen)
    ended_on_budget = {rid for rid, start, run in seen if start + len(run) == budgets[rid]}
    assert ended_on_budget == {rid for rid in RIDS if (budgets[rid] - 1) % (DRAFTS_PER_STEP + 1) != 1}
    assert_pool_whole(sched)


def whole_prefill_in_one_step(sched: Scheduler) -> None:
    """Every prompt of the workload prefilled in the first step, whatever the step-time budget measures (a
    fresh server's lone prefill step takes DEFAULT_LONE_PREFILL_TOKENS, fewer than the workload's prompts):
    the step-count reasoning of a test then starts with every request decoding from the same step. The budget
    of a model that is not fed is the chunk size, as under tensor parallelism."""
    sched.mixed_budget = MixedChunkBudget(adaptive=False)


class Oracle(Proposer):
    """Drafts the tokens each request produces without speculation: greedy verification accepts them all, so
    every verify step outputs as many tokens as the request's limits allow."""

    def __init__(self, outputs: dict[str, list[int]]):
        self.outputs = outputs

    def propose(self, requests, max_lens) -> Drafts:
        return Drafts(
            [
                self.outputs[r.rid][len(r.output_ids) : len(r.output_ids) + n]
                for r, n in zip(requests, max_lens, strict=True)
            ]
        )

    def release(self, rid: str) -> None:
        pass


def capture_runs(sched: Scheduler) -> list[tuple[str, int, list[int]]]:
    """Record (rid, output length before the step, tokens verification handed it) of each verify step."""
    seen: list[tuple[str, int, list[int]]] = []
    verify = sched.spec.verify

    def recording(logits, reqs, drafts):
        tokens, accepted = verify(logits, reqs, drafts)
        seen.extend((r.rid, len(r.output_ids), t) for r, t in zip(reqs, tokens, strict=True))
        return tokens, accepted

    sched.spec.verify = recording
    return seen


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(tiny_model_dir, quant, reference):
    """Find a verify step that output token t, not last in its run and never before in that request's output
    (drafts from an oracle, all accepted); with stop_token_ids=[t] the request must end right after t with the
    tokens before it, though the same step's run continued past t, and the rest of the run's slots are freed."""
    sched, _ = make(tiny_model_dir, quant)
    sched.spec.proposer = Oracle(reference)
    seen = capture_runs(sched)
    run_alone(sched, requests())
    candidates = [
        (rid, start + j, token)
        for rid, start, run in seen
        for j, token in enumerate(run[:-1])
        if token not in reference[rid][: start + j]
    ]
    assert candidates, "no accepted run holds a first occurrence before its last token"
    rid, at, stop = candidates[0]
    prompt = WORKLOAD[RIDS.index(rid)]
    sched, _ = make(tiny_model_dir, quant)
    sched.spec.proposer = Oracle(reference)
    seen = capture_runs(sched)
    res = drive(sched, {0: [request(rid, prompt, greedy(MAX_NEW, stop_token_ids=[stop]))]})[rid]
    assert res.output_ids == reference[rid][: at + 1]
    assert res.finish.type == "stop" and res.finish.matched == stop
    last_rid, start, run = seen[-1]
    assert last_rid == rid and start + run.index(stop) == at and run.index(stop) < len(run) - 1
    # the drafts after the stop were accepted by verification but are not output, so not counted: the last
    # step counts as one given only the drafts up to the stop, every one accepted
    assert res.spec_stats.accepted_tokens <= len(res.output_ids) - 1
    assert res.spec_stats.accepted_tokens == res.spec_stats.draft_tokens
    assert_pool_whole(sched)


def test_append_token_runs_stops_at_each_condition_inside_a_run():
    def req(**kw) -> Req:
        r = Req("r", [5, 6, 7], SamplingParams(temperature=0.0, **kw))
        r.output_ids = [8]
        return r

    stop, eos, cut = (
        req(max_new_tokens=20, stop_token_ids=[42]),
        req(max_new_tokens=20),
        req(max_new_tokens=3),
    )
    floor = req(max_new_tokens=20, stop_token_ids=[42], min_new_tokens=3)
    runs = [[10, 42, 11, 12], [10, 11, 2, 13], [10, 11, 12, 13], [42, 42, 11]]
    taken = append_token_runs(runs, [stop, eos, cut, floor], 1.0, frozenset({2}), context_len=1000)
    assert taken == [2, 3, 2, 2]
    assert stop.output_ids == [8, 10, 42] and stop.finished_reason.matched == 42
    assert eos.output_ids == [8, 10, 11, 2] and eos.finished_reason.matched == 2
    assert cut.output_ids == [8, 10, 11] and cut.finished_reason.type == "length"
    # below min_new_tokens a stop token is output like any other; once the floor is reached it ends the run
    assert floor.output_ids == [8, 42, 42] and floor.finished_reason.matched == 42
    assert len(stop.pending_ts) == 2  # one stamp per token, the step's


def test_a_constrained_request_decodes_plainly():
    """A grammar would have to be advanced over the drafts and rolled back: such a request takes none."""
    constrained = Req("g", [1], SamplingParams())
    constrained.grammar = object()  # structured output: its matcher
    assert may_speculate(Req("g", [1], SamplingParams(frequency_penalty=0.5, min_new_tokens=5)))
    assert not may_speculate(constrained)


class EveryThirdStep(Oracle):
    """The oracle's drafts, offered only when a request's output length is a multiple of 3."""

    def propose(self, requests, max_lens) -> Drafts:
        drafts = super().propose(requests, max_lens).token_ids
        return Drafts(
            [d if len(r.output_ids) % 3 == 0 else [] for r, d in zip(requests, drafts, strict=True)]
        )


PER_TOKEN_KINDS = {
    "frequency": dict(frequency_penalty=0.6),
    "presence": dict(presence_penalty=0.8),
    "repetition": dict(repetition_penalty=1.4),
    "all-three": dict(frequency_penalty=0.3, presence_penalty=0.3, repetition_penalty=1.2),
    "floor": dict(min_new_tokens=MAX_NEW, stop_token_ids=[VOCAB_LOW]),
}


@pytest.mark.parametrize("quant", QUANTIZATIONS)
def test_penalized_and_floored_requests_speculate_with_their_output_unchanged(tiny_model_dir, quant):
    """Penalties and the min_tokens ban act on each row of a run after its own context (the output and the
    drafts before it), and the penalty pool counts the appended tokens: drafted by an oracle (the answers
    without speculation, so a row judged after the wrong context would break the equality) at every third
    output length only (so the plain steps between read the penalty pool the verify steps updated), on
    prompts that repeat themselves (where penalties bite), every request gets exactly its tokens without
    speculation."""
    reqs = [
        request(name, WORKLOAD[i], greedy(MAX_NEW, **kw))
        for i, (name, kw) in enumerate(PER_TOKEN_KINDS.items())
    ]
    reqs += requests()[len(PER_TOKEN_KINDS) :]
    plain, _ = make(tiny_model_dir, quant, spec=False)
    refs = drive(plain, {0: reqs})
    sched, _ = make(tiny_model_dir, quant)
    sched.spec.proposer = EveryThirdStep({rid: c.output_ids for rid, c in refs.items()})
    res = drive(sched, {0: reqs})
    assert {rid: c.output_ids for rid, c in res.items()} == {rid: c.output_ids for rid, c in refs.items()}
    for name in PER_TOKEN_KINDS:
        stats = res[name].spec_stats
        assert stats.accepted_tokens == stats.draft_tokens > 0, name  # every oracle draft accepted
    assert_pool_whole(sched)


def test_per_request_figures_add_up_to_the_step_totals(tiny_model_dir):
    """Greedy and sampled requests (seeded and not), a small pool and an abort: the per-request
    figures each final message carries sum to the totals every verify step handed the reporter."""
    # near-greedy rows accept most drafts; top-k 5 at 0.7 rejects them (the recovered-token path)
    sampled_kinds = [
        dict(temperature=0.05),
        dict(temperature=0.05, seed=11),
        dict(temperature=0.7, top_k=5),
        dict(temperature=0.7, top_k=5, seed=12),
    ]
    sampled = [
        request(f"s{i}", p, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, **kw))
        for i, (p, kw) in enumerate(zip(WORKLOAD[:4], sampled_kinds, strict=True))
    ]
    sched, totals = make(tiny_model_dir, max_total_tokens=400)
    reqs = requests() + sampled
    res = drive(
        sched,
        {0: reqs[:8], 2: reqs[8:]},
        on_step=lambda step, s: step == 3 and s.abort_request(AbortReq(rid="r1")),
    )
    assert res["r1"].finish.type == "abort"
    figures = [c.spec_stats for c in res.values() if c.spec_stats is not None]
    assert sum(f.verify_steps for f in figures) == sum(s.num_drafts for s in totals.steps)
    assert sum(f.draft_tokens for f in figures) == sum(s.num_draft_tokens for s in totals.steps)
    assert sum(f.accepted_tokens for f in figures) == totals.accepted > 0
    assert all(sum(f.accepted_histogram) == f.verify_steps for f in figures)
    assert all(f.accepted_tokens <= f.draft_tokens for f in figures)
    sampled_figures = [res[r.rid].spec_stats for r in sampled]
    assert all(f is not None and f.verify_steps > 0 for f in sampled_figures)
    assert sum(f.accepted_tokens for f in sampled_figures) > 0
    per_position = [0] * DRAFTS_PER_STEP
    for s in totals.steps:
        assert len(s.accepted_per_position) <= DRAFTS_PER_STEP
        for j, n in enumerate(s.accepted_per_position):
            per_position[j] += n
    assert per_position == sorted(per_position, reverse=True)
    assert sum(per_position) == totals.accepted
    assert per_position[0] <= sum(s.num_drafts for s in totals.steps)
    assert_pool_whole(sched)


@pytest.fixture(scope="module")
def other_random_model_dir(model_assets_dir, tmp_path_factory) -> str:
    """The tiny Llama's shapes and tokenizer with other random weights: a draft model that guesses badly."""
    from test.conftest import TINY_LLAMA, TINY_SEED, assets_config, save_random_llama

    fields = dict(vocab_size=assets_config(model_assets_dir)["vocab_size"], **TINY_LLAMA)
    return save_random_llama(tmp_path_factory.mktemp("other_llama"), model_assets_dir, TINY_SEED + 1, fields)


@pytest.mark.parametrize("draft", ["itself", "other"])
def test_greedy_output_is_the_same_with_a_draft_model(
    tiny_model_dir, other_random_model_dir, reference, quant, draft
):
    """STANDALONE: the model drafting for itself has nearly every draft accepted; a model of other random
    weights has nearly none accepted; either way the tokens are those without speculation, and the draft
    model's own pool is whole at the end."""
    path = tiny_model_dir if draft == "itself" else other_random_model_dir
    sched, totals = make(
        tiny_model_dir,
        quant,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=path,
        disable_mixed_chunk=True,
    )
    reqs = requests()
    res = drive(sched, {0: reqs[:6], 3: reqs[6:]}, on_step=assert_every_slot_accounted)
    assert {rid: c.output_ids for rid, c in res.items()} == reference
    drafted = sum(s.num_draft_tokens for s in totals.steps)
    rate = totals.accepted / drafted
    if draft == "itself":
        assert rate > 0.9, rate
    else:
        assert drafted > 0 and rate < 0.2, rate
    assert_pool_whole(sched)
    proposer = sched.spec.proposer
    assert not proposer.seqs  # every finished request released its draft KV
    assert proposer.runner.token_to_kv_pool_allocator.available_size() == proposer.runner.max_total_num_tokens


def test_a_large_batch_decodes_plainly_and_a_small_one_speculates(tiny_model_dir):
    """40 requests decoding together: a verify step would feed over TEST_STEP_TOKENS, so none runs (budget 0), and
    the tokens are those without speculation; 4 requests take all their drafts."""
    many = [request(f"m{i}", p, greedy(6)) for i, p in enumerate(grounded_prompts(40, seed=3))]
    plain, _ = make(tiny_model_dir, spec=False, max_running_requests=48)
    want = {rid: c.output_ids for rid, c in drive(plain, {0: many}).items()}
    sched, totals = make(
        tiny_model_dir, max_running_requests=48, speculative_num_draft_tokens=12, disable_mixed_chunk=True
    )
    got = drive(sched, {0: many})
    assert {rid: c.output_ids for rid, c in got.items()} == want
    assert totals.budgets and set(totals.budgets) == {0} and not totals.steps
    few, few_totals = make(tiny_model_dir, speculative_num_draft_tokens=12, disable_mixed_chunk=True)
    drive(few, {0: many[:4]})
    assert few_totals.budgets[0] == 11 and few_totals.steps


# ---- OpenAI's Predicted Outputs (a request's `prediction_ids`) ----


def edited(tokens: list[int], seed: int) -> list[int]:
    """A prediction that is the answer with a span replaced and a token dropped: drafting must resume after
    each edit, and the tokens it drafts across an edit are rejected."""
    rng = random.Random(seed)
    out = list(tokens)
    at = rng.randrange(2, len(out) - 6)
    out[at : at + 3] = [VOCAB_LOW, VOCAB_LOW + 1, VOCAB_LOW + 2, VOCAB_LOW + 3]
    del out[at + 8]
    return out


def predicted_requests(reference: dict[str, list[int]]):
    """Every request of the workload, half with their exact answer as the prediction, half with an edited
    one, one with none."""
    reqs = requests()
    for i, req in enumerate(reqs[:-1]):
        answer = reference[req.rid]
        req.prediction_ids = answer if i % 2 == 0 else edited(answer, i)
    return reqs


@pytest.mark.parametrize("spec", [False, True], ids=["no-algorithm", "ngram"])
def test_greedy_output_is_the_same_with_predictions(tiny_model_dir, quant, reference, spec):
    """A prediction drafts on any server, the server's algorithm or none; the output is the model's, not the
    prediction's; every slot is accounted for after each step; the per-request figures add up to the step
    totals; the prediction's counts are those of the drafts the prediction gave (past an edit a request may
    draft from its own tokens), and its accepted and rejected tokens never exceed the completion."""
    sched, totals = make(tiny_model_dir, quant, spec=spec)
    reqs = predicted_requests(reference)
    res = drive(sched, {0: reqs[:6], 3: reqs[6:]}, on_step=assert_every_slot_accounted)
    assert {rid: c.output_ids for rid, c in res.items()} == reference
    with_prediction = [res[r.rid].spec_stats for r in reqs if r.prediction_ids]
    assert all(f is not None for f in with_prediction)
    drafted = sum(f.prediction_draft_tokens for f in with_prediction)
    accepted = sum(f.prediction_accepted_tokens for f in with_prediction)
    figures = [c.spec_stats for c in res.values() if c.spec_stats is not None]
    assert sum(f.accepted_tokens for f in figures) == totals.accepted
    assert all(f.prediction_draft_tokens <= f.draft_tokens for f in with_prediction)
    for r in (r for r in reqs if r.prediction_ids):  # completion positions, the prefill's token none of them
        assert sum(res[r.rid].spec_stats.prediction_usage().values()) <= len(res[r.rid].output_ids) - 1
    assert 0 < accepted < drafted, "edited predictions must have drafts rejected, exact ones accepted"
    exact = [res[r.rid].spec_stats for r in reqs[:-1:2]]
    assert all(f.prediction_accepted_tokens == f.prediction_draft_tokens for f in exact)
    unpredicted = res[reqs[-1].rid].spec_stats
    assert (unpredicted is None) == (
        not spec
    )  # without an algorithm, a request without prediction never drafts
    assert_pool_whole(sched)
    assert_cache_holds_only_output(sched, reference)
    assert not sched.spec.predictions.predictions  # released when each request finished
    assert not len(sched.spec.predictions.own_tokens.histories)


def test_a_prediction_takes_more_drafts_a_step_than_ngram(tiny_model_dir, reference):
    """A request's prediction drafts up to PREDICTION_DRAFTS_PER_STEP tokens a step (its text is accepted far
    more often than an n-gram guess), the algorithm's requests up to their k."""
    from srt.speculative.defaults import PREDICTION_DRAFTS_PER_STEP

    sched, _ = make(tiny_model_dir)
    reqs = requests()[:2]
    reqs[0].prediction_ids = reference[reqs[0].rid]
    longest = {r.rid: 0 for r in reqs}
    verify = sched.spec.verify

    def recording(logits, verifying, drafts):
        for r, d in zip(verifying, drafts, strict=True):
            longest[r.rid] = max(longest[r.rid], len(d))
        return verify(logits, verifying, drafts)

    sched.spec.verify = recording
    drive(sched, {0: reqs})
    assert longest[reqs[0].rid] == PREDICTION_DRAFTS_PER_STEP > DRAFTS_PER_STEP
    assert 0 < longest[reqs[1].rid] <= DRAFTS_PER_STEP


# ---- sampled requests: the output distribution through the scheduler ----
SAMPLED_RUNS = 800
# a p-value below this rejects "same distribution": a correct scheduler fails about once in 10,000 runs
FALSE_ALARM = 1e-4


def sampled_joint_counts(sched: Scheduler, first_seed: int) -> dict[tuple[int, ...], int]:
    """How often each 3-token answer came out of SAMPLED_RUNS seeded requests (top-3 at temperature 1: a
    small joint support, so each cell has counts chi-square can judge)."""
    params = [
        SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3, ignore_eos=True, seed=first_seed + i)
        for i in range(SAMPLED_RUNS)
    ]
    prompt = WORKLOAD[0]
    reqs = [request(f"x{i}", prompt, p) for i, p in enumerate(params)]
    res = drive(sched, {0: reqs})
    counts: dict[tuple[int, ...], int] = {}
    for c in res.values():
        key = tuple(c.output_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def two_sample_p_value(a: dict, b: dict) -> float:
    """P(chi-square >= observed) that two samples of categories come from one distribution (a 2 x C table,
    df = C - 1)."""
    cells = sorted(set(a) | set(b))
    table = torch.tensor([[a.get(c, 0) for c in cells], [b.get(c, 0) for c in cells]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2.0), stat / 2))


def test_sampled_answers_are_distributed_as_without_speculation(tiny_model_dir):
    """Seeded sampled requests (top-3, temperature 1) through a scheduler without speculation and one whose
    model drafts greedily for itself (its drafts are the argmax, accepted with probability p(argmax) and
    otherwise replaced by the recovered token): the joint distribution of the 3-token answers is the same
    (two-sample chi-square over disjoint seeds), with both paths taken."""
    plain, _ = make(tiny_model_dir, spec=False, max_running_requests=32)
    spec, totals = make(
        tiny_model_dir,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=tiny_model_dir,
        max_running_requests=32,
        disable_mixed_chunk=True,
    )
    reference = sampled_joint_counts(plain, first_seed=0)
    speculated = sampled_joint_counts(spec, first_seed=SAMPLED_RUNS)
    drafted = sum(s.num_draft_tokens for s in totals.steps)
    assert 0 < totals.accepted < drafted, "the accept and the recovered-token paths must both run"
    assert len(reference) > 3  # the answers vary: the comparison has categories to compare
    assert two_sample_p_value(reference, speculated) > FALSE_ALARM


@pytest.mark.parametrize("top", [0, 3])
def test_requests_with_logprobs_speculate_and_report_each_tokens_logprobs(
    tiny_model_dir, quant, reference, top
):
    """A request asking for logprobs drafts like any other; each token it outputs comes with the logprob and
    alternatives of the row it was chosen from: what it reports without speculation (the same ids; values
    equal to float rounding, since a verify row and a decode row may run different kernels)."""
    reqs = requests(logprobs=top)
    plain, _ = make(tiny_model_dir, quant, spec=False)
    want = drive(plain, {0: reqs})
    sched, totals = make(tiny_model_dir, quant)
    got = drive(sched, {0: reqs})
    assert totals.accepted > 0 and all(got[r.rid].spec_stats is not None for r in reqs[:8])
    for rid, c in got.items():
        w = want[rid]
        assert c.output_ids == w.output_ids == reference[rid]
        assert len(c.token_logprobs) == len(c.output_ids) == len(c.top_logprobs)
        assert c.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4)
        assert [[t for t, _ in row] for row in c.top_logprobs] == [
            [t for t, _ in row] for row in w.top_logprobs
        ]
        assert all(len(row) == top for row in c.top_logprobs)
