"""The draft-model proposer (`--speculative-algorithm STANDALONE`): a model drafting for itself proposes exactly
its own greedy continuation; after drafts are rejected, its KV follows the request's real tokens, so a warm
proposer drafts what a cold one drafts for the same history; it never drafts past what it is allowed; a full
pool means no drafts, never an error; and releasing every request gives back every slot and row."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.model_runner import ModelRunner
from srt.speculative.draft_model import DraftModelProposer
from test.unit.model_driver import PagedDriver

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="srt's CPU kernels do not load here")

K = 4
PROMPTS = [[random.Random(i).randrange(10, 5000) for _ in range(n)] for i, n in enumerate((7, 19, 12))]


@pytest.fixture(scope="module")
def int8_runners(tiny_model_dir, tmp_path_factory) -> tuple[ModelRunner, ModelRunner]:
    """(target, draft): the same int8 model twice. The int8 CPU model is batch-invariant to the bit (a token's
    numbers do not depend on how it was fed), so equalities below are exact, with no near-tie allowance."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SRT_CACHE_DIR", str(tmp_path_factory.mktemp("int8_cache")))
    kw = dict(max_total_tokens=1024, max_running_requests=8, quantization="w8a8_int8")
    runners = ModelRunner(tiny_model_dir, **kw), ModelRunner(tiny_model_dir, **kw)
    mp.undo()
    return runners


def request(rid: str, prompt: list[int], output: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids=prompt, output_ids=list(output or []))


def test_a_model_drafting_for_itself_proposes_its_own_greedy_tokens(int8_runners):
    target, draft = int8_runners
    proposer = DraftModelProposer(draft, K)
    want = [trace.tokens for trace in PagedDriver(target).greedy(PROMPTS, K)]
    reqs = [request(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    assert proposer.propose(reqs, [K] * len(reqs)).token_ids == want
    # one more step after accepting all K drafts and the bonus token: the next K greedy tokens
    longer = [trace.tokens for trace in PagedDriver(target).greedy(PROMPTS, 2 * K + 1)]
    for req, tokens in zip(reqs, longer, strict=True):
        req.output_ids = tokens[: K + 1]
    assert proposer.propose(reqs, [K] * len(reqs)).token_ids == [t[K + 1 : 2 * K + 1] for t in longer]
    for req in reqs:
        proposer.release(req.rid)


def test_after_rejections_a_warm_proposer_drafts_what_a_cold_one_does(int8_runners):
    _, draft = int8_runners
    warm = DraftModelProposer(draft, K)
    reqs = [request(f"w{i}", p) for i, p in enumerate(PROMPTS)]
    drafts = warm.propose(reqs, [K] * len(reqs)).token_ids
    # the verifier accepted a different number of drafts per request, then appended a token of its own
    for req, d, accepted in zip(reqs, drafts, (0, 2, K), strict=True):
        req.output_ids = [*d[:accepted], (d[accepted] + 1) % 4000 + 10 if accepted < K else 77]
    again = warm.propose(reqs, [K, 1, 3]).token_ids
    cold = DraftModelProposer(draft, K)
    fresh = [request(f"c{i}", r.origin_input_ids, r.output_ids) for i, r in enumerate(reqs)]
    assert again == cold.propose(fresh, [K, 1, 3]).token_ids
    assert [len(d) for d in again] == [K, 1, 3]  # never more than allowed
    for r in reqs:
        warm.release(r.rid)
    for r in fresh:
        cold.release(r.rid)


def test_releasing_every_request_gives_back_every_slot_and_row(int8_runners):
    _, draft = int8_runners
    slots_before = draft.token_to_kv_pool_allocator.available_size()
    rows_before = draft.req_to_token_pool.available_size()
    proposer = DraftModelProposer(draft, K)
    reqs = [request(f"l{i}", p) for i, p in enumerate(PROMPTS)]
    proposer.propose(reqs, [K, 0, 2])
    reqs[0].output_ids = [5, 6]
    proposer.propose(reqs, [K, K, K])
    assert draft.token_to_kv_pool_allocator.available_size() < slots_before
    for r in reqs:
        proposer.release(r.rid)
    assert draft.token_to_kv_pool_allocator.available_size() == slots_before
    assert draft.req_to_token_pool.available_size() == rows_before


def test_each_draft_row_holds_the_slots_of_exactly_its_cached_tokens(int8_runners):
    """The target's rule, in the draft pool: after drafts are rejected and the next propose has run, the slots in
    use are exactly those of every sequence's cached tokens, each held once."""
    _, draft = int8_runners
    allocator, table = draft.token_to_kv_pool_allocator, draft.req_to_token_pool.req_to_token
    free_before = allocator.available_size()
    proposer = DraftModelProposer(draft, K)
    reqs = [request(f"k{i}", p) for i, p in enumerate(PROMPTS)]
    drafts = proposer.propose(reqs, [K] * len(reqs)).token_ids
    for req, d, accepted in zip(reqs, drafts, (1, 0, 3), strict=True):
        req.output_ids = [*d[:accepted], 11]
    proposer.propose(reqs, [K, 2, 1])
    seqs = [proposer.seqs[r.rid] for r in reqs]
    held = torch.cat([table[s.row, : len(s.tokens)] for s in seqs]).tolist()
    assert len(set(held)) == len(held) == free_before - allocator.available_size()
    for r in reqs:
        proposer.release(r.rid)


def test_a_full_draft_pool_means_no_drafts_this_step(int8_runners):
    _, draft = int8_runners
    proposer = DraftModelProposer(draft, K)
    allocator = draft.token_to_kv_pool_allocator
    hog = allocator.alloc(allocator.available_size() - 3)  # room for 3 tokens: no prompt fits
    try:
        reqs = [request("f0", PROMPTS[1])]
        assert proposer.propose(reqs, [K]).token_ids == [[]]
    finally:
        proposer.release("f0")
        allocator.free(hog)
