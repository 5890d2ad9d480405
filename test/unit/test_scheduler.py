"""The scheduler's contract, on a tiny randomly initialised Llama: continuous batching, admission within
budgets, chunked prefill, prefix reuse, retraction and abort all leave every request's greedy output exactly
what it would have been alone, and the KV pool is whole again afterwards."""

from __future__ import annotations

import logging
import random
import re
from itertools import pairwise

import pytest

from srt.io_struct import AbortReq
from srt.model_executor.model_runner import ModelRunner
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs
from test.unit.scheduler_driver import drive, greedy, request

VOCAB_LOW, VOCAB_HIGH = 10, 200  # token ids used in synthetic prompts (avoid special tokens)


def make_scheduler(model_dir: str, **overrides) -> Scheduler:
    """fp32 unless `quantization` says otherwise (the tiny model is not what int8's default was gated on)."""
    args = ServerArgs(
        **{"max_total_tokens": 4096, "max_running_requests": 16, "quantization": "none", **overrides}
    )
    runner = ModelRunner(
        model_dir,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        quantization=args.quantization,
    )
    return Scheduler(args, runner)


@pytest.fixture(scope="module", autouse=True)
def private_int8_cache(tmp_path_factory):
    """The int8 tests quantize the session's tiny model: its cache goes with it, not into ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SRT_CACHE_DIR", str(tmp_path_factory.mktemp("srt-cache")))
    yield
    mp.undo()


def prompts(n: int, low: int = 5, high: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(low, high))] for _ in range(n)]


def assert_pool_whole(sched: Scheduler) -> None:
    assert sched.is_idle
    assert sched.num_used_tokens == 0
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


# The equivalence tests run in fp32 and in int8 (the CPU default), whose fused kernels switch from one
# kernel to another with the number of tokens in a step: a sequence's tokens must not depend on that.
QUANTIZATIONS = ["none", "w8a8_int8"]


@pytest.fixture(scope="module", params=QUANTIZATIONS)
def quant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def alone_outputs(tiny_model_dir, quant):
    """Reference: each prompt run alone on a fresh scheduler."""
    sched = make_scheduler(tiny_model_dir, quantization=quant)
    refs = {}
    for i, p in enumerate(prompts(6)):
        res = drive(sched, {0: [request(f"r{i}", p, greedy(12))]})
        refs[f"r{i}"] = res[f"r{i}"].output_ids
        sched.flush_cache()
    return refs


# The equivalence tests run with and without mixed prefill/decode steps (mixed is the CPU default).
MIXED = pytest.mark.parametrize("mixed", [False, True], ids=["unmixed", "mixed"])


def mixing(mixed: bool) -> dict[str, bool]:
    return {"enable_mixed_chunk": True} if mixed else {"disable_mixed_chunk": True}


@MIXED
def test_continuous_batching_matches_running_alone(tiny_model_dir, alone_outputs, mixed, quant):
    sched = make_scheduler(tiny_model_dir, quantization=quant, **mixing(mixed))
    ps = prompts(6)
    arrivals = {
        0: [request("r0", ps[0], greedy(12)), request("r1", ps[1], greedy(12))],
        3: [request("r2", ps[2], greedy(12))],
        5: [request("r3", ps[3], greedy(12)), request("r4", ps[4], greedy(12))],
        9: [request("r5", ps[5], greedy(12))],
    }
    res = drive(sched, arrivals)
    for rid, ref in alone_outputs.items():
        assert res[rid].output_ids == ref, rid
        assert res[rid].finish.type == "length"
    assert_pool_whole(sched)


def test_prefill_budget_limits_admission(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, max_prefill_tokens=50, chunked_prefill_size=-1)
    for i, p in enumerate(prompts(4, low=20, high=20)):
        sched.add_request(request(f"r{i}", p, greedy(4)))
    sched.step()
    # 20-token prompts under a 50-token budget: two fit in the first prefill batch, the rest wait.
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_max_running_requests_is_respected(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, max_running_requests=3)
    seen = []
    reqs = [request(f"r{i}", p, greedy(6)) for i, p in enumerate(prompts(7))]
    drive(sched, {0: reqs}, on_step=lambda step, s: seen.append(len(s.running)))
    assert max(seen) == 3


@MIXED
def test_chunked_prefill_gives_same_tokens(tiny_model_dir, mixed, quant):
    long_prompt = prompts(1, low=150, high=150, seed=3)[0]
    plain = drive(
        make_scheduler(tiny_model_dir, chunked_prefill_size=-1, quantization=quant),
        {0: [request("a", long_prompt, greedy(8))]},
    )
    sched = make_scheduler(tiny_model_dir, chunked_prefill_size=32, quantization=quant, **mixing(mixed))
    prefill_steps = []
    res = drive(
        sched,
        {0: [request("a", long_prompt, greedy(8))]},
        on_step=lambda step, s: prefill_steps.append(s.chunked_req is not None),
    )
    assert sum(prefill_steps) == 150 // 32  # steps that left a chunk pending
    assert res["a"].output_ids == plain["a"].output_ids
    assert_pool_whole(sched)


@MIXED
def test_prefix_cache_hit_gives_same_tokens(tiny_model_dir, mixed, quant):
    shared = prompts(1, low=64, high=64, seed=5)[0]
    sched = make_scheduler(tiny_model_dir, quantization=quant, **mixing(mixed))
    first = drive(sched, {0: [request("a", shared + [11, 12], greedy(8))]})
    # with mixed chunks, b's prefix hit is prefilled next to a decoding request
    busy = {
        0: [request("busy", prompts(1, seed=6)[0], greedy(12))],
        2: [request("b", shared + [11, 12], greedy(8))],
    }
    second = drive(sched, busy)
    cold = drive(
        make_scheduler(tiny_model_dir, disable_radix_cache=True, quantization=quant),
        {0: [request("c", shared + [11, 12], greedy(8))]},
    )
    assert first["a"].cached_tokens == 0
    assert second["b"].cached_tokens == len(shared) + 1  # everything but the last prompt token
    assert cold["c"].cached_tokens == 0
    assert second["b"].output_ids == first["a"].output_ids == cold["c"].output_ids


@MIXED
def test_retraction_resumes_with_identical_output(tiny_model_dir, mixed, quant):
    # 8 requests of 30 prompt + 40 output tokens need 560 slots; the pool has 300.
    ps = prompts(8, low=30, high=30, seed=7)
    ref_sched = make_scheduler(tiny_model_dir, quantization=quant)
    refs = {
        f"r{i}": drive(ref_sched, {0: [request(f"r{i}", p, greedy(40))]})[f"r{i}"].output_ids
        for i, p in enumerate(ps)
    }
    sched = make_scheduler(tiny_model_dir, max_total_tokens=300, quantization=quant, **mixing(mixed))
    # half arrive later, so that with mixed chunks they are admitted next to decoding requests
    arrivals = {0: [request(f"r{i}", p, greedy(40)) for i, p in enumerate(ps[:4])]}
    arrivals[3] = [request(f"r{i}", p, greedy(40)) for i, p in enumerate(ps) if i >= 4]
    res = drive(sched, arrivals)
    assert sum(r.num_retractions for r in res.values()) > 0
    for rid, ref in refs.items():
        assert res[rid].output_ids == ref, rid
        assert len(res[rid].output_ids) == 40
    # Event order holds; a retracted request keeps its first scheduling time.
    for r in res.values():
        assert r.queued_ts <= r.scheduled_ts <= r.first_token_ts <= r.token_ts[-1]
        assert r.token_ts == sorted(r.token_ts)
    assert_pool_whole(sched)


def test_a_request_that_outgrows_the_whole_pool_ends_with_length_and_says_why(tiny_model_dir):
    """Alone and still out of KV slots, there is nothing left to retract: it finishes, the pool is whole."""
    sched = make_scheduler(tiny_model_dir, max_total_tokens=64)
    res = drive(sched, {0: [request("big", prompts(1, low=40, high=40)[0], greedy(60))]})
    finish = res["big"].finish
    assert finish.type == "length" and "KV cache cannot hold" in finish.message
    assert 0 < len(res["big"].output_ids) < 60
    assert res["big"].num_retractions == 0
    assert_pool_whole(sched)


def test_abort_frees_memory_everywhere(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, max_running_requests=2)
    ps = prompts(4)
    for i, p in enumerate(ps):
        sched.add_request(request(f"r{i}", p, greedy(50)))
    for _ in range(3):
        sched.step()
    assert sched.running and sched.waiting
    sched.abort_request(AbortReq(rid="r0"))
    sched.abort_request(AbortReq(rid="r3"))
    out = sched.step()
    aborted = {
        rid
        for rid, f in zip(out.rids, out.finished_reasons, strict=True)
        if f is not None and f.type == "abort"
    }
    assert aborted == {"r0", "r3"}
    sched.abort_request(AbortReq(rid=""))
    sched.step()
    assert_pool_whole(sched)


def test_streaming_sends_first_token_at_once_and_every_interval(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, stream_interval=4)
    res = drive(
        sched,
        {
            0: [
                request("s", prompts(1)[0], greedy(9), stream=True),
                request("n", prompts(1, seed=2)[0], greedy(9), stream=False),
            ]
        },
    )
    assert res["s"].messages == 1 + 2  # first token, then tokens 2-5 and 6-9 (the last carries the finish)
    assert res["n"].messages == 2  # first token at once (for TTFT), the rest on finish
    assert len(res["s"].token_ts) == 9


def test_stop_conditions(tiny_model_dir, alone_outputs):
    sched = make_scheduler(tiny_model_dir)
    p = prompts(6)[0]
    target = alone_outputs["r0"][3]
    stop_at = alone_outputs["r0"].index(target)
    res = drive(
        sched,
        {
            0: [
                request("stop", p, greedy(12, stop_token_ids=[target])),
                request("zero", p, greedy(0)),
                request("empty", [], greedy(4)),
                request("min", p, greedy(12, stop_token_ids=[target], min_new_tokens=stop_at + 2)),
            ]
        },
    )
    assert res["stop"].finish.type == "stop" and res["stop"].output_ids == alone_outputs["r0"][: stop_at + 1]
    assert res["zero"].finish.type == "length" and res["zero"].output_ids == []
    assert res["empty"].finish.type == "error"
    assert len(res["min"].output_ids) > stop_at + 1


def test_running_requests_are_not_starved_by_a_burst_of_prefills(tiny_model_dir):
    # One request is decoding when eight more arrive that need four prefill batches between them.
    sched = make_scheduler(
        tiny_model_dir, max_prefill_tokens=40, chunked_prefill_size=-1, disable_mixed_chunk=True
    )
    modes = []

    def record(step, s):
        modes.append("prefill" if s.last_step_was_prefill else "decode")

    burst = [request(f"b{i}", p, greedy(4)) for i, p in enumerate(prompts(8, low=20, high=20, seed=9))]
    res = drive(sched, {0: [request("first", prompts(1)[0], greedy(30))], 2: burst}, on_step=record)
    first_prefill = modes.index("prefill", 1)
    assert modes.count("prefill") >= 1 + 4
    # after the burst arrives, no two prefill steps are adjacent while anything decodes
    assert all(not (a == b == "prefill") for a, b in pairwise(modes[first_prefill:]))
    assert len(res["first"].output_ids) == 30


@MIXED
def test_a_short_prompt_does_not_wait_for_a_long_prompts_remaining_chunks(tiny_model_dir, mixed):
    """A long prompt mid-chunk: a short request arriving then is prefilled in the very next step, ahead of the
    long prompt's remaining chunks (which share that step: the long prompt always progresses), and both
    outputs are what they are alone."""
    from srt.scheduler.mixed_chunk import MIN_MIXED_PREFILL_TOKENS

    long_prompt = prompts(1, low=600, high=600, seed=5)[0]
    short = prompts(1, low=6, high=6, seed=6)[0]
    alone = {
        rid: drive(make_scheduler(tiny_model_dir), {0: [request(rid, p, greedy(4))]})[rid].output_ids
        for rid, p in (("long", long_prompt), ("short", short))
    }
    sched = make_scheduler(tiny_model_dir, chunked_prefill_size=128, **mixing(mixed))
    progress = []  # (step, the long prompt's prefilled tokens, whether the short request has been scheduled)

    def record(step, s):
        long_req = s.chunked_req
        progress.append((step, None if long_req is None else long_req.kv_len, s.waiting == []))

    res = drive(
        sched,
        {0: [request("long", long_prompt, greedy(4))], 1: [request("short", short, greedy(4))]},
        on_step=record,
    )
    assert progress[1][2], "the short request waited behind the long prompt's remaining chunks"
    assert progress[0][1] is not None and progress[1][1] is not None  # the long prompt is still mid-chunk ...
    assert progress[1][1] - progress[0][1] >= MIN_MIXED_PREFILL_TOKENS  # ... and advanced in that step
    assert res["short"].first_token_ts < res["long"].first_token_ts
    assert {rid: c.output_ids for rid, c in res.items()} == alone
    assert_pool_whole(sched)


def test_debug_log_gives_every_steps_prefill_tokens_decode_rows_and_forward_time(tiny_model_dir, caplog):
    """`--log-level debug`: one line a step, whose counts add up to the prompts and the decoded tokens."""
    ps = prompts(3, seed=11)
    sched = make_scheduler(tiny_model_dir, enable_mixed_chunk=True)
    with caplog.at_level(logging.DEBUG, logger="srt.scheduler.step_executor"):
        res = drive(
            sched,
            {0: [request("a", ps[0], greedy(5))], 2: [request(f"r{i}", ps[i], greedy(4)) for i in (1, 2)]},
        )
    steps = [
        re.fullmatch(r"step: (\d+) prefill tokens, (\d+) decode rows, forward ([\d.]+) ms", r.getMessage())
        for r in caplog.records
        if r.getMessage().startswith("step:")
    ]
    assert steps and all(steps)
    assert sum(int(m[1]) for m in steps) == sum(len(p) for p in ps)
    # every output token but each request's first (sampled in its prefill step) came from a decode row
    assert sum(int(m[2]) for m in steps) == sum(len(r.output_ids) - 1 for r in res.values()) == 4 + 3 + 3
    assert all(float(m[3]) > 0 for m in steps)
    assert any(int(m[1]) and int(m[2]) for m in steps)  # a mixed step: the late arrivals ride along
