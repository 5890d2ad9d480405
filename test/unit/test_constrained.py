"""Specification of structured output's grammar layer: each backend compiles and masks over the embedded
model's real tokenizer, the manager compiles off the loop and caches by (kind, spec), bad constraints fail
with a clear error, and the bitmask is applied as one masked fill over the constrained rows only."""

from __future__ import annotations

import json
import time

import pytest
import torch

from srt.constrained import (
    GRAMMAR_BACKENDS,
    GrammarError,
    GrammarKey,
    constraint_key,
    create_grammar_backend,
)
from srt.constrained.bitmask import GrammarMask, allocate_bitmask, apply_token_bitmask, forbidden_tokens
from srt.constrained.grammar_manager import GrammarCache, GrammarManager
from srt.sampling.sampling_params import SamplingParams

BACKENDS = [b for b in GRAMMAR_BACKENDS if b != "none"]
THREE_DIGITS = GrammarKey("regex", "[0-9]{3}")
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["name", "tags"],
    }
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from srt.model_source import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer):
    return create_grammar_backend(request.param, tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def allowed_ids(backend, matcher) -> list[int]:
    bitmask = allocate_bitmask(1, backend.vocab_size)
    backend.fill_bitmask([matcher], bitmask)
    return (~forbidden_tokens(bitmask, backend.vocab_size)[0]).nonzero().flatten().tolist()


def test_regex_allows_only_digits_then_only_eos(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(THREE_DIGITS))
    eos = tokenizer.eos_token_id
    text = ""
    while len(text) < 3:
        allowed = allowed_ids(backend, matcher)
        assert allowed and eos not in allowed
        pieces = {tokenizer.decode([t]) for t in allowed}
        assert all(p.isdigit() and len(p) <= 3 - len(text) for p in pieces), sorted(pieces)[:10]
        token = allowed[0]
        assert matcher.accept_token(token)
        text += tokenizer.decode([token])
    assert allowed_ids(backend, matcher) == [eos]
    # The match is complete: llguidance reports the end at once, xgrammar once EOS is accepted.
    assert matcher.is_terminated() or matcher.accept_token(eos)
    assert matcher.is_terminated()


def test_matcher_rejects_a_forbidden_token(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(THREE_DIGITS))
    letter = tokenizer("a", add_special_tokens=False).input_ids[0]
    assert not matcher.accept_token(letter)


def test_json_schema_compiles_and_accepts_a_valid_instance(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(GrammarKey("json_schema", SCHEMA)))
    ids = tokenizer('{"name":"x","tags":["a","b"]}', add_special_tokens=False).input_ids
    for t in ids:
        assert t in allowed_ids(backend, matcher)
        assert matcher.accept_token(t)
    assert allowed_ids(backend, matcher) == [tokenizer.eos_token_id]


@pytest.mark.parametrize(
    "key, words",
    [
        (GrammarKey("json_schema", '{"type": "strin"}'), "strin"),
        (GrammarKey("json_schema", "{not json"), "json_schema"),
        (GrammarKey("regex", "[0-9"), "regex"),
        (GrammarKey("ebnf", 'root ::= "a" undefined_rule'), "ebnf"),
    ],
)
def test_bad_constraint_raises_a_clear_error(backend, key, words):
    with pytest.raises(GrammarError) as err:
        backend.judge(key)
    assert err.value.kind == key.kind and words in str(err.value)
    with pytest.raises(GrammarError):
        backend.compile(key)


def test_judge_passes_a_good_constraint(backend):
    backend.judge(THREE_DIGITS)
    backend.judge(GrammarKey("json_schema", SCHEMA))


# ---- the manager: off-loop compilation and the cache ----


class CountingMetrics:
    def __init__(self):
        self.compiles, self.hits, self.requests, self.queue = [], 0, 0, []

    def on_compiled(self, seconds):
        self.compiles.append(seconds)

    def on_cache_hit(self):
        self.hits += 1

    def on_request(self):
        self.requests += 1

    def set_queue(self, n):
        self.queue.append(n)


class FakeReq:
    def __init__(self, rid, **constraint):
        self.rid = rid
        self.sampling_params = SamplingParams(**constraint)
        self.grammar = None


def wait_ready(manager, n, timeout=30.0):
    ready, failed = [], []
    deadline = time.monotonic() + timeout
    while len(ready) + len(failed) < n and time.monotonic() < deadline:
        r, f = manager.pop_ready()
        ready += r
        failed += f
        time.sleep(0.005)
    return ready, failed


def make_manager(tokenizer, metrics, **kw) -> GrammarManager:
    return GrammarManager(
        "llguidance", lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id], metrics, **kw
    )


def test_manager_compiles_on_a_worker_and_caches_by_kind_and_spec(tokenizer):
    metrics = CountingMetrics()
    manager = make_manager(tokenizer, metrics)
    reqs = [FakeReq(f"r{i}", regex="[0-9]{3}") for i in range(3)] + [FakeReq("j", json_schema=SCHEMA)]
    for req in reqs:
        manager.submit(req, constraint_key(req.sampling_params))
    ready, failed = wait_ready(manager, len(reqs))
    assert not failed and {r.rid for r in ready} == {r.rid for r in reqs}
    assert len(metrics.compiles) == 2  # one per distinct (kind, spec)
    assert metrics.hits == 2 and metrics.requests == 4
    assert metrics.queue[-1] == 0 and max(metrics.queue) >= 1
    assert all(r.grammar is not None for r in ready)
    assert ready[0].grammar is not ready[1].grammar  # each request has its own matcher
    manager.submit(FakeReq("again", regex="[0-9]{3}"), THREE_DIGITS)
    assert metrics.hits == 3 and len(metrics.compiles) == 2
    manager.shutdown()


def test_manager_fails_only_the_request_with_a_bad_grammar(tokenizer):
    manager = make_manager(tokenizer, None, synchronous=True)
    good, bad = FakeReq("good", regex="[a-z]+"), FakeReq("bad", regex="[a-z")
    for req in (good, bad):
        manager.submit(req, constraint_key(req.sampling_params))
    ready, failed = manager.pop_ready()
    assert [r.rid for r in ready] == ["good"]
    assert [r.rid for r, _ in failed] == ["bad"] and isinstance(failed[0][1], GrammarError)
    assert len(manager.cache) == 1  # a failure is not cached


def test_cache_is_lru():
    cache = GrammarCache(size=2)
    for name in "abc":
        if name == "c":
            cache.get(GrammarKey("regex", "a"))  # a was used: b is the oldest
        cache.put(GrammarKey("regex", name), name)
    assert cache.get(GrammarKey("regex", "b")) is None
    assert cache.get(GrammarKey("regex", "a")) == "a" and cache.get(GrammarKey("regex", "c")) == "c"


# ---- the bitmask ----


def random_bitmask(rows: int, vocab: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)


def reference_forbidden(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = [[(int(w) >> j) & 1 for w in row for j in range(32)][:vocab] for row in bitmask.tolist()]
    return torch.tensor(bits) == 0


def test_forbidden_tokens_matches_the_bit_layout():
    bitmask = random_bitmask(3, 70)
    assert torch.equal(forbidden_tokens(bitmask, 70), reference_forbidden(bitmask, 70))


def test_mask_touches_only_the_constrained_rows():
    logits = torch.randn(4, 70)
    before = logits.clone()
    bitmask = random_bitmask(2, 70)
    GrammarMask(bitmask, [1, 3], 70).apply(logits)
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    forbid = reference_forbidden(bitmask, 70)
    for k, row in enumerate([1, 3]):
        assert torch.all(logits[row][forbid[k]] == float("-inf"))
        assert torch.equal(logits[row][~forbid[k]], before[row][~forbid[k]])
    one = GrammarMask(bitmask, [1, 3], 70).for_row(3)
    assert one.rows == [0] and torch.equal(one.bitmask, bitmask[1:2])
    assert GrammarMask(bitmask, [1, 3], 70).for_row(0) is None


def test_apply_token_bitmask_whole_batch():
    logits = torch.zeros(2, 40)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[1, 1] = 1 << 2  # token 34
    apply_token_bitmask(logits, bitmask, 40)
    assert (logits[0] == 0).nonzero().flatten().tolist() == [5]
    assert (logits[1] == 0).nonzero().flatten().tolist() == [34]
