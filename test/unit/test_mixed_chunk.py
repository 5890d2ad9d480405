"""Mixed prefill/decode steps (`--enable-mixed-chunk`): a prompt that arrives while others decode is prefilled
in the same forward step as their decode, its tokens and theirs are counted once each in the step metrics,
and the prefill budget follows the documented rule (srt/scheduler/mixed_chunk.py)."""

from __future__ import annotations

import pytest

from srt.scheduler.mixed_chunk import (
    DEFAULT_LONE_PREFILL_TOKENS,
    DEFAULT_MIXED_PREFILL_TOKENS,
    LONE_PREFILL_STEP_SECONDS,
    MIN_LONE_PREFILL_TOKENS,
    MIN_MIXED_PREFILL_TOKENS,
    MIXED_STEP_FLOOR_SECONDS,
    MixedChunkBudget,
    attention_keys,
    mixed_chunk_enabled,
)
from srt.scheduler.step_reporter import SchedulerReporter
from srt.server_args import ServerArgs
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import assert_pool_whole, make_scheduler, prompts


class RecordingCollector:
    """Stands in for SchedulerMetricsCollector: records what the reporter hands it per step."""

    def __init__(self):
        self.prefill_compute = self.prefill_cache = self.decode = 0
        self.step_tokens: list[int] = []
        self.extend_seconds = self.decode_seconds = 0.0

    def on_prefill_batch(self, new_seqs, new_tokens, cached, queries, hits, seconds, decode_tokens=0):
        self.prefill_compute += new_tokens
        self.prefill_cache += cached
        self.decode += decode_tokens
        self.extend_seconds += seconds
        self.step_tokens.append(new_tokens + decode_tokens)

    def on_decode_batch(self, num_tokens, seconds):
        self.decode += num_tokens
        self.decode_seconds += seconds
        self.step_tokens.append(num_tokens)

    def on_finished_request(self, *args):
        pass

    def flush(self, stats):
        pass


def test_a_prompt_arriving_while_others_decode_is_prefilled_in_a_mixed_step(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, enable_mixed_chunk=True)
    collector = RecordingCollector()
    sched.reporter = SchedulerReporter(ServerArgs(), sched.allocator.size, collector)
    ps = prompts(3, low=20, high=30, seed=11)
    steps = []

    def record(step, s):
        steps.append((s.last_step_was_prefill, s.last_step_was_mixed, len(s.running)))

    arrivals = {0: [request("a", ps[0], greedy(10))], 3: [request("b", ps[1], greedy(6))]}
    arrivals[5] = [request("c", ps[2], greedy(4))]
    res = drive(sched, arrivals, on_step=record)

    # step 0 prefills a alone; b (step 3) and c (step 5) each join a's decode in one mixed step
    assert steps[0] == (True, False, 1)
    assert steps[3] == (True, True, 2) and steps[5] == (True, True, 3)
    assert sum(mixed for _, mixed, _ in steps) == 2
    # token accounting: every prompt token once, every token after a request's first one decoded once
    outputs = {rid: len(r.output_ids) for rid, r in res.items()}
    assert outputs == {"a": 10, "b": 6, "c": 4}
    assert collector.prefill_compute + collector.prefill_cache == sum(map(len, ps))
    assert collector.decode == sum(n - 1 for n in outputs.values())
    # one iteration-size observation per forward step; a mixed step counts its prompt and decode tokens
    assert len(collector.step_tokens) == len(steps)
    assert collector.step_tokens[3] == len(ps[1]) + 1 and collector.step_tokens[5] == len(ps[2]) + 2
    assert sum(collector.step_tokens) == collector.prefill_compute + collector.decode
    assert_pool_whole(sched)


def test_mixed_prefill_budget_is_capped_by_the_chunk_size_and_splits_long_prompts(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, enable_mixed_chunk=True, chunked_prefill_size=16)
    long_prompt = prompts(1, low=70, high=70, seed=12)[0]
    chunks = []

    def record(step, s):
        if s.last_step_was_mixed:
            chunks.append(s.chunked_req is not None)

    plain = drive(make_scheduler(tiny_model_dir), {0: [request("b", long_prompt, greedy(5))]})
    res = drive(
        sched,
        {0: [request("a", prompts(1, seed=13)[0], greedy(30))], 2: [request("b", long_prompt, greedy(5))]},
        on_step=record,
    )
    assert chunks[:5] == [True, True, True, True, False]  # 70 tokens in mixed chunks of 16
    assert res["b"].output_ids == plain["b"].output_ids
    assert_pool_whole(sched)


def test_budget_follows_the_documented_rule():
    budget = MixedChunkBudget(multiple=3.0, floor_seconds=0.0)
    assert budget.prefill_tokens(4) == DEFAULT_MIXED_PREFILL_TOKENS  # nothing measured yet
    fixed, per_token = 0.060, 0.002
    for _ in range(40):  # prefill, decode and mixed steps of an exact linear cost model
        budget.observe(256, 0, fixed + per_token * 256)
        budget.observe(0, 4, fixed + per_token * 4)
        budget.observe(64, 4, fixed + per_token * 68)
    assert budget.fixed_seconds == pytest.approx(fixed, rel=0.01)
    assert budget.token_seconds == pytest.approx(per_token, rel=0.01)
    expected = (3.0 - 1) * (fixed + per_token * 8) / per_token  # a + b(D + C) = 3 (a + b D), D = 8
    assert budget.prefill_tokens(8) == pytest.approx(expected, abs=1)
    assert budget.prefill_tokens(8) > budget.prefill_tokens(1)
    budget.observe(0, 1, 0.0)  # a step faster than the model's per-token cost never drives it negative
    assert budget.fixed_seconds >= 0
    slow = MixedChunkBudget()
    slow.fixed_seconds, slow.token_seconds = 0.0, 1.0
    assert slow.prefill_tokens(1) == MIN_MIXED_PREFILL_TOKENS


def test_a_small_batch_may_fill_the_floor_and_a_large_one_its_multiple():
    """A few decoding requests make a cheap decode step; the mixed step may still last the floor, so
    prefill chunks do not shrink to where each step's fixed cost dominates."""
    budget = MixedChunkBudget(multiple=4.0, floor_seconds=0.3)
    budget.fixed_seconds, budget.token_seconds = 0.010, 0.001
    assert budget.prefill_tokens(8) == pytest.approx(
        (0.3 - 0.010) / 0.001 - 8, abs=1
    )  # floor: 282, multiple: 54
    assert budget.prefill_tokens(128) == pytest.approx(
        3 * (0.010 + 0.001 * 128) / 0.001, abs=1
    )  # multiple: 414
    # with a still unknown (only mixed steps so far), the floor counts it as 0
    budget.fixed_seconds = None
    assert budget.prefill_tokens(8) == pytest.approx(0.3 / 0.001 - 8, abs=1)
    assert MixedChunkBudget().floor_seconds == MIXED_STEP_FLOOR_SECONDS


def test_budget_without_timing_stays_at_the_default():
    """With tensor parallelism the ranks' timings differ, and their scheduling must not."""
    budget = MixedChunkBudget(adaptive=False)
    budget.observe(256, 0, 0.5)
    budget.observe(0, 4, 0.06)
    assert budget.prefill_tokens(4) == DEFAULT_MIXED_PREFILL_TOKENS


def test_a_prefill_step_with_nothing_decoding_is_bounded_in_time_once_the_cost_is_known():
    budget = MixedChunkBudget()
    # unmeasured: a first step a CPU takes in about a second; not fed (tensor parallelism): the chunk size alone
    assert budget.lone_prefill_tokens() == DEFAULT_LONE_PREFILL_TOKENS
    assert MixedChunkBudget(adaptive=False).lone_prefill_tokens() is None
    budget.fixed_seconds, budget.token_seconds = 0.010, 0.005
    assert budget.lone_prefill_tokens() == pytest.approx((LONE_PREFILL_STEP_SECONDS - 0.010) / 0.005, abs=1)
    # a step continuing a long prompt next to decoding requests: their rows come out of the same second
    assert budget.lone_prefill_tokens(8) == pytest.approx(budget.lone_prefill_tokens() - 8, abs=1)
    # a step of one token already costs more (a busy CPU, each step's fixed cost charged to its tokens): a
    # chunk that still makes progress at a small share of fixed cost, not one that shrinks with the estimate
    budget.token_seconds = 10.0
    assert budget.lone_prefill_tokens() == MIN_LONE_PREFILL_TOKENS


def test_a_step_attends_to_each_rows_context():
    # 3 tokens after 10 in KV attend to 11, 12 and 13 keys; a decode row after 7 to 8
    assert attention_keys([(10, 3), (7, 1)]) == 11 + 12 + 13 + 8
    assert attention_keys([]) == 0


def _long_prompt_steps(budget: MixedChunkBudget, truth, length: int) -> list[float]:
    """A prompt of `length` tokens prefilled alone in the budget's lone steps, each step's true time fed back."""
    times, prefix = [], 0
    while prefix < length:
        chunk = min(budget.lone_prefill_tokens(prefix=prefix), length - prefix)
        keys = attention_keys([(prefix, chunk)])
        times.append(truth(chunk, keys))
        budget.observe(chunk, 0, times[-1], keys)
        prefix += chunk
    return times


def test_a_long_prompts_chunks_keep_their_time_budget_as_its_context_grows():
    """Attention makes a token deep into a long prompt cost several times a short prompt's: priced per token
    alone, each chunk was sized at the earlier chunks' cost and ran over the step's budget by a quarter at a
    3,000-token context. The model learns the cost per key from the chunks' spread of contexts."""
    a, b, c = 0.010, 0.0008, 0.8e-6  # a 2-core CPU's order of magnitude: 0.8 ms a token, +0.8 us a key

    def truth(tokens: int, keys: int) -> float:
        return a + b * tokens + c * keys

    def warmed(budget: MixedChunkBudget) -> MixedChunkBudget:
        for n in (200, 250, 180, 220):  # short prompts and decode steps: nothing yet about c
            budget.observe(n, 0, truth(n, attention_keys([(0, n)])), attention_keys([(0, n)]))
            budget.observe(0, 4, truth(4, attention_keys([(300, 1)] * 4)), attention_keys([(300, 1)] * 4))
        assert budget.key_seconds == 0.0  # short prompts alike in size do not tell b from c
        return budget

    times = _long_prompt_steps(warmed(MixedChunkBudget()), truth, 8000)
    assert max(times[2:]) <= LONE_PREFILL_STEP_SECONDS * 1.05  # once two chunks have shown the trend
    learnt = warmed(MixedChunkBudget())
    _long_prompt_steps(learnt, truth, 8000)
    assert learnt.key_seconds == pytest.approx(c, rel=0.05)
    assert learnt.token_seconds == pytest.approx(b, rel=0.05)
    blind = warmed(MixedChunkBudget())  # the per-token model alone, for contrast: it overruns
    blind._chunk_moments.slope = lambda: None
    blind.keys_fitted = True  # nor guarded
    assert max(_long_prompt_steps(blind, truth, 8000)) > LONE_PREFILL_STEP_SECONDS * 1.15


def test_a_fresh_servers_first_long_prompt_keeps_its_budget_while_the_model_learns_attention():
    """A fresh server has measured only short prompts, whose tokens also carry their step's overhead: its
    first long prompt's chunks reach contexts never measured. Until c is measured those keys are guarded, so
    no chunk overruns; and the long prompt's own chunks teach c, which short prompts' overhead does not hide."""
    # p: a prefill step's own overhead, which a decode step lacks; c: attention at 2 us a key
    a, p, b, c = 0.010, 0.005, 0.0005, 2e-6

    def prefill(tokens: int, keys: int) -> float:
        return a + p + b * tokens + c * keys

    def fresh() -> MixedChunkBudget:
        budget = MixedChunkBudget()
        for _ in range(4):  # short prompts, each decoding a few tokens
            budget.observe(24, 0, prefill(24, attention_keys([(0, 24)])), attention_keys([(0, 24)]))
            for length in range(24, 30):
                budget.observe(0, 1, a + b + c * (length + 1), length + 1)
        return budget

    learning = fresh()
    times = _long_prompt_steps(learning, prefill, 3000)
    assert max(times) <= LONE_PREFILL_STEP_SECONDS * 1.05
    assert learning.key_seconds == pytest.approx(c, rel=0.2)
    assert sum(times) <= 1.15 * prefill(3000, attention_keys([(0, 3000)]))  # no crawl: few, full steps
    unguarded = fresh()
    unguarded.keys_fitted = True  # priced as if c were known to be 0 until it is
    assert max(_long_prompt_steps(unguarded, prefill, 3000)) > LONE_PREFILL_STEP_SECONDS * 1.25


def test_a_mixed_steps_decode_rows_are_priced_by_their_context():
    budget = MixedChunkBudget(multiple=4.0, floor_seconds=0.0)
    budget.fixed_seconds, budget.token_seconds, budget.key_seconds = 0.010, 0.001, 1e-6
    short = budget.prefill_tokens(8, attention_keys([(100, 1)] * 8))
    long = budget.prefill_tokens(8, attention_keys([(4000, 1)] * 8))
    assert long > short  # a dearer decode step allows a larger prefill beside it (its multiple)
    assert budget.lone_prefill_tokens(8, attention_keys([(4000, 1)] * 8)) < budget.lone_prefill_tokens(8)
    assert budget.lone_prefill_tokens(prefix=6000) < budget.lone_prefill_tokens(prefix=0)


def test_a_lone_long_prompt_is_prefilled_in_time_bounded_steps(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, chunked_prefill_size=4096, enable_mixed_chunk=True)
    sched.mixed_budget.fixed_seconds, sched.mixed_budget.token_seconds = 0.0, LONE_PREFILL_STEP_SECONDS / 200
    sched.mixed_budget.adaptive = False  # keep the cost model where the test put it
    steps = []
    res = drive(
        sched,
        {0: [request("long", prompts(1, low=900, high=900)[0], greedy(2))]},
        on_step=lambda step, s: steps.append(s.chunked_req is not None),
    )
    assert sum(steps) == 4  # 900 tokens in steps of 200: four left a chunk pending
    assert len(res["long"].output_ids) == 2


def test_mixed_chunks_are_the_cpu_default_and_can_be_turned_off():
    assert mixed_chunk_enabled(ServerArgs(), "cpu")
    assert not mixed_chunk_enabled(ServerArgs(disable_mixed_chunk=True), "cpu")
    assert not mixed_chunk_enabled(ServerArgs(), "cuda")  # not measured there: opt-in
    assert mixed_chunk_enabled(ServerArgs(enable_mixed_chunk=True), "cuda")
    with pytest.raises(ValueError, match="contradict"):
        ServerArgs(enable_mixed_chunk=True, disable_mixed_chunk=True)
    assert ServerArgs.parse(["--disable-mixed-chunk"]).disable_mixed_chunk
