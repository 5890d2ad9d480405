"""Prompt logprobs in the scheduler, on a tiny randomly initialised Llama: equal to a teacher-forced
transformers forward, whether the prompt was cached before, prefilled in chunks or scored with no output
token at all; from `logprob_start_len` on; and the KV pool is whole afterwards. The LM head scores the rows
a block at a time, with the scores of scoring them at once, and a block leaves nothing behind."""

from __future__ import annotations

import random
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from srt.model_executor import model_runner
from srt.model_executor.layers import cpu_kernels
from srt.model_executor.model_runner import ModelRunner
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs
from test.unit.scheduler_driver import MAX_STEPS, greedy, request

TOLERANCE = 1e-4
TOP = 3


def make_scheduler(model_dir: str, quantization: str = "none", **overrides) -> Scheduler:
    args = ServerArgs(**{"max_total_tokens": 4096, "max_running_requests": 16, **overrides})
    runner = ModelRunner(
        model_dir, max_total_tokens=args.max_total_tokens, max_running_requests=16, quantization=quantization
    )
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
    chunks next to that decode (srt/scheduler/mixed_chunk.py) and its logprobs are still the reference's."""
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


# Smaller than every prompt below and dividing none of their lengths: each step scores several blocks, the
# last one partial, and blocks cross from one request's rows into the next's.
SMALL_BLOCK = 7
ONE_BLOCK = 1 << 20  # every row of a step through the head at once
BLOCK_PROMPTS = {"a": (prompt(45, seed=6), TOP), "b": (prompt(38, seed=7), 1), "c": (prompt(29, seed=8), 0)}


def score_together(sched: Scheduler, tag: str) -> dict[str, tuple]:
    """Add BLOCK_PROMPTS at once (prompt logprobs from position 0, two output tokens each), step until idle;
    per prompt its prompt logprobs, top alternatives and output ids."""
    got = {name: [None, None, []] for name in BLOCK_PROMPTS}
    for name, (ids, k) in BLOCK_PROMPTS.items():
        sched.add_request(request(f"{tag}-{name}", ids, greedy(2, logprobs=k, logprob_start_len=0)))
    for _ in range(MAX_STEPS):
        out = sched.step()
        for i, rid in enumerate(out.rids if out is not None else []):
            entry = got[rid.split("-", 1)[1]]
            entry[2] += out.output_ids[i]
            if out.input_token_logprobs is not None and out.input_token_logprobs[i] is not None:
                entry[0], entry[1] = out.input_token_logprobs[i], out.input_top_logprobs[i]
        if sched.is_idle:
            return {name: tuple(v) for name, v in got.items()}
    raise AssertionError("requests did not finish")


# MKL's fp32 GEMM takes another kernel for fewer than 8 rows, so an fp32 head's rows scored in blocks of
# SMALL_BLOCK can differ by an ulp or so from the same rows scored at once; the int8 head multiplies integers
# exactly and its rows agree to the bit.
FP32_HEAD_TOLERANCE = 1e-5


def assert_same_scores(got: dict[str, tuple], want: dict[str, tuple], exact: bool) -> None:
    if exact:
        assert got == want
        return
    for name, (values, tops, output_ids) in got.items():
        want_values, want_tops, want_output_ids = want[name]
        assert output_ids == want_output_ids
        assert values[0] is None and tops[0] is None
        assert values[1:] == pytest.approx(want_values[1:], abs=FP32_HEAD_TOLERANCE, rel=0)
        for top, want_top in zip(tops[1:], want_tops[1:], strict=True):
            assert [t for t, _ in top] == [t for t, _ in want_top]
            assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=FP32_HEAD_TOLERANCE)


@pytest.mark.parametrize("quantization", ["w8a8_int8", "none"])
def test_scoring_in_blocks_gives_the_scores_of_scoring_at_once(
    tiny_model_dir, tmp_path, monkeypatch, quantization
):
    """Each row's log-softmax is its own and the head scores each row alone: blocking changes nothing (to
    the bit with the int8 head), over chunked prefill and a batch of requests asking for different numbers of
    alternatives."""
    int8 = quantization == "w8a8_int8"
    if int8 and cpu_kernels.load() is None:
        pytest.skip("srt's CPU kernels do not load here")
    monkeypatch.setenv("SRT_CACHE_DIR", str(tmp_path))  # the int8 head's calibration cache
    sched = make_scheduler(tiny_model_dir, quantization, chunked_prefill_size=48)
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_BLOCK_ROWS", ONE_BLOCK)
    at_once = score_together(sched, "once")
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_BLOCK_ROWS", SMALL_BLOCK)
    # the positions asked for are recomputed, not taken from the cache the first run left
    in_blocks = score_together(sched, "blocks")
    assert_same_scores(in_blocks, at_once, exact=int8)
    for name, (ids, k) in BLOCK_PROMPTS.items():
        values, tops, _ = in_blocks[name]
        assert len(values) == len(ids) and all(len(t) == k for t in tops[1:])
    assert_pool_whole(sched)


class TensorsMade(TorchDispatchMode):
    """Weak references to every tensor an op returns while active, collected since the last `take`."""

    def __init__(self):
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def take(self) -> list[weakref.ref]:
        made, self.made = self.made, []
        return made


def test_the_head_scores_a_block_at_a_time_and_a_block_leaves_nothing_behind(tiny_model_dir, monkeypatch):
    """The bound on a step's transient memory, whatever the prompt's length: the head never sees more than
    PROMPT_LOGPROB_BLOCK_ROWS rows, and when it scores a block, every tensor the previous block made (its
    logits, log-probabilities, even its chosen-token and top-k values, written into the step's results) is
    gone. Small results kept block by block would sit in the holes the freed blocks leave, and a heap that
    keeps what it frees, as the scheduler's does, would grow with the prompt."""
    sched = make_scheduler(tiny_model_dir)
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_BLOCK_ROWS", SMALL_BLOCK)
    head, tensors = sched.runner.model.compute_logits, TensorsMade()
    head_rows = []

    def watched_head(hidden: torch.Tensor) -> torch.Tensor:
        left = [ref() for ref in tensors.take()]  # made since the previous call, this call's rows among them
        if len(head_rows) > 1:  # the previous call scored a block (the first one, the step's last tokens)
            assert all(t is None or t is hidden for t in left), "the previous block left tensors behind"
        head_rows.append(hidden.shape[0])
        return head(hidden)

    monkeypatch.setattr(sched.runner.model, "compute_logits", watched_head)
    ids = prompt(60, seed=9)
    with tensors:
        got = run(sched, "long", ids, greedy(0, logprobs=TOP, logprob_start_len=0))
    # one head call for the step's last-token logits, then ceil(59 / 7) blocks
    assert head_rows == [1] + [SMALL_BLOCK] * 8 + [59 - 8 * SMALL_BLOCK]
    assert len(got["input"]) == len(ids) and all(len(top) == TOP for top in got["tops"][1:])
