"""Prompt logprobs in the scheduler, on a tiny randomly initialised Llama: equal to a teacher-forced
transformers forward, whether the prompt was cached before, prefilled in chunks or scored with no output
token at all; from `logprob_start_len` on; and the KV pool is whole afterwards."""

from __future__ import annotations

import random

import pytest
import torch

from srt.managers.scheduler import Scheduler
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from test.unit.scheduler_driver import MAX_STEPS, greedy, request

TOLERANCE = 1e-4
TOP = 3


def make_scheduler(model_dir: str, **overrides) -> Scheduler:
    args = ServerArgs(**{"max_total_tokens": 4096, "max_running_requests": 16, **overrides})
    runner = ModelRunner(model_dir, max_total_tokens=args.max_total_tokens, max_running_requests=16)
    return Scheduler(args, runner)


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 200) for _ in range(length)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Teacher-forced log-probabilities of each prompt token under transformers (row i scores token i + 1)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def score(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return score


def run(sched: Scheduler, rid: str, ids: list[int], params) -> dict:
    """Step until `rid` finishes; its output ids, finish reason and prompt logprobs (sent once)."""
    sched.add_request(request(rid, ids, params))
    got = {"output_ids": [], "input": None, "tops": None, "messages_with_input": 0}
    for _ in range(MAX_STEPS):
        out = sched.step()
        if out is None or rid not in out.rids:
            continue
        i = out.rids.index(rid)
        got["output_ids"] += out.output_ids[i]
        if out.input_token_logprobs is not None and out.input_token_logprobs[i] is not None:
            got["input"], got["tops"] = out.input_token_logprobs[i], out.input_top_logprobs[i]
            got["messages_with_input"] += 1
        if out.finished_reasons[i] is not None:
            got["finish"] = out.finished_reasons[i]
            return got
    raise AssertionError("request did not finish")


def assert_matches(got: dict, ref: torch.Tensor, ids: list[int], start: int = 0) -> None:
    values = got["input"]
    assert len(values) == len(ids) - start and got["messages_with_input"] == 1
    if start == 0:
        assert values[0] is None and got["tops"][0] is None
    for pos in range(max(start, 1), len(ids)):
        k = pos - start
        assert abs(values[k] - ref[pos - 1, ids[pos]].item()) < TOLERANCE, pos
        best = ref[pos - 1].topk(TOP)
        assert [t for t, _ in got["tops"][k]] == best.indices.tolist()
        assert all(
            abs(v - b) < TOLERANCE for (_, v), b in zip(got["tops"][k], best.values.tolist(), strict=True)
        )


def assert_pool_whole(sched: Scheduler) -> None:
    assert sched.is_idle and sched.num_used_tokens == 0


def test_prompt_logprobs_equal_transformers(tiny_model_dir, reference):
    sched = make_scheduler(tiny_model_dir)
    ids = prompt(30)
    got = run(sched, "a", ids, greedy(3, logprobs=TOP, logprob_start_len=0))
    assert_matches(got, reference(ids), ids)
    assert len(got["output_ids"]) == 3
    assert_pool_whole(sched)


def test_after_a_prefix_cache_hit_the_asked_positions_are_recomputed(tiny_model_dir, reference):
    sched = make_scheduler(tiny_model_dir)
    ids = prompt(30, seed=1)
    plain = run(sched, "warm", ids, greedy(4))
    got = run(sched, "again", ids, greedy(4, logprobs=TOP, logprob_start_len=0))
    assert_matches(got, reference(ids), ids)
    assert got["output_ids"] == plain["output_ids"]
    # a later start may use the cache up to the first position it needs
    late = run(sched, "late", ids, greedy(4, logprobs=TOP, logprob_start_len=20))
    assert_matches(late, reference(ids), ids, start=20)
    assert late["output_ids"] == plain["output_ids"]
    assert_pool_whole(sched)
    hit = run(sched, "hit", ids, greedy(2))  # the cache still serves the prompt correctly
    assert hit["output_ids"] == plain["output_ids"][:2]


def test_chunked_prefill_gathers_prompt_logprobs_over_its_chunks(tiny_model_dir, reference):
    sched = make_scheduler(tiny_model_dir, chunked_prefill_size=16)
    ids = prompt(57, seed=2)
    got = run(sched, "chunked", ids, greedy(3, logprobs=TOP, logprob_start_len=0))
    assert_matches(got, reference(ids), ids)
    assert_pool_whole(sched)


def test_zero_new_tokens_scores_the_prompt_only(tiny_model_dir, reference):
    sched = make_scheduler(tiny_model_dir)
    ids = prompt(12, seed=3)
    got = run(sched, "score", ids, greedy(0, logprobs=TOP, logprob_start_len=0))
    assert got["output_ids"] == [] and got["finish"].type == "length"
    assert_matches(got, reference(ids), ids)
    one = run(sched, "one", ids[:1], greedy(0, logprobs=0, logprob_start_len=0))
    assert one["input"] == [None] and one["finish"].type == "length"
    assert_pool_whole(sched)


def test_batches_mix_requests_with_and_without_prompt_logprobs(tiny_model_dir, reference):
    sched = make_scheduler(tiny_model_dir)
    a, b = prompt(20, seed=4), prompt(25, seed=5)
    sched.add_request(request("plain", a, greedy(2)))
    got = run(sched, "asks", b, greedy(2, logprobs=TOP, logprob_start_len=0))
    assert_matches(got, reference(b), b)
    while not sched.is_idle:
        sched.step()
    assert_pool_whole(sched)


def test_prompt_logprobs_of_a_prompt_prefilled_in_mixed_steps(tiny_model_dir, reference):
    """A prompt asking for its logprobs arrives while another request decodes: it is prefilled in mixed
    chunks next to that decode (srt/managers/mixed_chunk.py) and its logprobs are still the reference's."""
    sched = make_scheduler(tiny_model_dir, enable_mixed_chunk=True, chunked_prefill_size=16)
    sched.add_request(request("busy", prompt(10, seed=4), greedy(30)))
    sched.step()
    ids = prompt(40, seed=5)
    mixed_steps = []
    step = sched.step

    def counting_step():
        out = step()
        mixed_steps.append(sched.last_step_was_mixed)
        return out

    sched.step = counting_step
    got = run(sched, "scored", ids, greedy(3, logprobs=TOP, logprob_start_len=0))
    assert sum(mixed_steps) >= 3  # 40 prompt tokens in mixed chunks of 16
    assert_matches(got, reference(ids), ids)
