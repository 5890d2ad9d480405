"""Tensor parallelism on the CPU (gloo), on the tiny Llama (4 heads, 2 KV heads): two ranks, each holding half
the heads and half the MLP, compute the logits of one unsplit model, and two schedulers fed the same inputs
in lockstep produce the tokens a single-rank scheduler produces."""

from __future__ import annotations

import os

import pytest
import torch

from srt.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.quantization import cache_path
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler
from srt.scheduler.step_hooks import StepReporter
from srt.server_args import ServerArgs
from test.unit.model_driver import PagedDriver
from test.unit.scheduler_driver import greedy, request
from test.unit.tp_ranks import run_ranks

TP = 2
ATOL = 1e-4  # fp32: the all-reduce only changes the summation order
MAX_STEPS = 500
KV_TOKENS = 1024
CHUNK = 16  # smaller than the long prompt below, so it is prefilled in pieces
DECODE_STEPS = 4


def prompts() -> dict[str, list[int]]:
    return {
        "short": [11, 12, 13, 14, 15],
        "mid": list(range(100, 123)),
        "long": [(7 * i) % 180 + 10 for i in range(41)],  # 41 tokens: three chunks of <= 16
    }


# NGRAM speculative decoding: every rank must propose, verify and free the same drafts in the same steps
# (without mixed steps, whose running requests decode plainly, so that verify steps run while prompts arrive)
SPECULATIVE = {
    "speculative_algorithm": "NGRAM",
    "speculative_num_draft_tokens": 4,
    "disable_mixed_chunk": True,
}


def scheduler_args(tp_size: int, **extra) -> ServerArgs:
    return ServerArgs(
        max_total_tokens=KV_TOKENS,
        max_running_requests=8,
        chunked_prefill_size=CHUNK,
        tp_size=tp_size,
        **extra,
    )


def make_runner(
    model_dir: str, tp_rank: int = 0, tp_size: int = 1, init: str | None = None, quantization: str = "none"
) -> ModelRunner:
    return ModelRunner(
        model_dir,
        max_total_tokens=KV_TOKENS,
        max_running_requests=8,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dist_init_method=init,
        quantization=quantization,
    )


# ---- the work each rank does (the same code runs the single-rank reference) ----
def forward_trace(runner: ModelRunner) -> torch.Tensor:
    """Logits of a batched extend, greedy decode steps, and an extend after a cached prefix, stacked."""
    driver = PagedDriver(runner)
    ps = list(prompts().values())
    seqs = [driver.new_seq() for _ in ps]
    rows = [driver.extend(seqs, ps)]
    for _ in range(DECODE_STEPS):
        rows.append(driver.decode(seqs, rows[-1].argmax(-1).tolist()))
    rows.append(driver.extend(seqs[:1], [[21, 22, 23]]))  # continues after 5 + DECODE_STEPS cached tokens
    return torch.cat(rows)


def biased_pair_output(tp: TensorParallelGroup) -> torch.Tensor:
    """A fused column-parallel layer (two shards, as gate/up) whose shard product feeds a row-parallel layer,
    both with bias, loaded from the same seeded full-size tensors on every rank."""
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(*shape, generator=gen) for name, shape in PAIR_SHAPES.items()}
    col = ColumnParallelLinear(8, {"a": 6, "b": 6}, bias=True, tp=tp)
    row = RowParallelLinear(6, 3, bias=True, tp=tp)
    for i, shard in enumerate(("a", "b")):
        for param in ("weight", "bias"):
            target, source = col.checkpoint_slice(param, shard, full[f"col.{param}"][6 * i : 6 * (i + 1)])
            target.copy_(source)
    for param in ("weight", "bias"):
        target, source = row.checkpoint_slice(param, None, full[f"row.{param}"])
        target.copy_(source)
    with torch.no_grad():
        a, b = col(full["x"]).chunk(2, dim=-1)
        return row(a * b)


PAIR_SHAPES = {"col.weight": (12, 8), "col.bias": (12,), "row.weight": (3, 6), "row.bias": (3,), "x": (5, 8)}


class VerifySteps(StepReporter):
    """Counts the requests' verify steps (speculative decoding)."""

    def __init__(self) -> None:
        self.count = 0

    def on_verify(self, step) -> None:
        self.count += step.num_drafts


def lockstep_generate(
    runner: ModelRunner, tp_size: int, reporter: StepReporter | None = None, **extra
) -> dict[str, list[int]]:
    """Scheduler outputs with inputs arriving over several steps; rank 0 broadcasts each step's messages and
    every rank dispatches them and steps, as the server's loop does. `extra`: more ServerArgs fields; with
    speculation a request whose prompt repeats itself joins (its drafts are accepted)."""
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    sched = Scheduler(scheduler_args(tp_size, **extra), runner, reporter=reporter)
    ps = prompts()
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, ignore_eos=True)
    arrivals = {
        0: [request("short", ps["short"], greedy(8)), request("long", ps["long"], greedy(8))],
        2: [request("mid", ps["mid"], greedy(8)), request("sampled", ps["mid"], sampled)],
    }
    if extra.get("speculative_algorithm"):
        arrivals[0].append(request("repeat", ps["short"] * 4, greedy(16)))
    outputs: dict[str, list[int]] = {}
    for step in range(MAX_STEPS):
        msgs = runner.tp.broadcast_object(arrivals.get(step, []) if runner.tp.rank == 0 else None)
        for msg in msgs:
            sched.handle(msg)
        out = sched.step()
        for rid, ids in zip(out.rids if out else [], out.output_ids if out else [], strict=True):
            outputs.setdefault(rid, []).extend(ids)
        if step > max(arrivals) and sched.is_idle:
            return outputs
    raise AssertionError("the scheduler did not finish")


def rank_report(tp_rank: int, model_dir: str, init: str, cache_dir: str) -> dict:
    runner = make_runner(model_dir, tp_rank, TP, init)
    tp = runner.tp
    k_buf, _ = runner.token_to_kv_pool.get_kv_buffer(0)
    report = {
        "kv_heads": k_buf.shape[1],
        "capacity": runner.max_total_num_tokens,
        "gathered": tp.all_gather(torch.full((1, 2), float(tp_rank))),
        "min": tp.min_across_ranks(10 + tp_rank),
        "pair": biased_pair_output(tp),
        "logits": forward_trace(runner),
    }
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    report["generated"] = lockstep_generate(runner, TP)
    verify_steps = VerifySteps()
    report["generated_speculative"] = lockstep_generate(runner, TP, verify_steps, **SPECULATIVE)
    report["verify_steps"] = verify_steps.count
    tp.destroy()
    # int8: each rank calibrates and quantizes its own shard (a fresh group: one per process at a time)
    os.environ["SRT_CACHE_DIR"] = cache_dir
    int8 = make_runner(model_dir, tp_rank, TP, f"{init}-int8", quantization="w8a8_int8")
    report["int8_logits"] = forward_trace(int8)
    int8.tp.destroy()
    # a start cut short after rank 0 saved its file: rank 1 finds none, so both must calibrate again
    # (rank 0 alone loading its file would leave rank 1's calibration waiting on its collectives)
    if tp_rank == 1:
        os.unlink(cache_path(int8.model_dir, tp_rank, TP))
    again = make_runner(model_dir, tp_rank, TP, f"{init}-int8-again", quantization="w8a8_int8")
    report["int8_again_logits"] = forward_trace(again)
    report["int8_cache_restored"] = os.path.isfile(cache_path(again.model_dir, tp_rank, TP))
    again.tp.destroy()
    return report


@pytest.fixture(scope="module")
def rank_reports(tiny_model_dir, tmp_path_factory) -> dict[int, dict]:
    init = f"file://{tmp_path_factory.mktemp('tp') / 'init'}"
    cache_dir = str(tmp_path_factory.mktemp("int8_cache"))
    return run_ranks(rank_report, TP, tiny_model_dir, init, cache_dir)


@pytest.fixture(scope="module")
def single_rank(tiny_model_dir) -> dict:
    runner = make_runner(tiny_model_dir)
    logits = forward_trace(runner)
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    return {
        "logits": logits,
        "generated": lockstep_generate(runner, 1),
        "generated_speculative": lockstep_generate(runner, 1, **SPECULATIVE),
    }


def test_each_rank_holds_half_the_kv_heads_and_the_same_capacity(rank_reports):
    assert [rank_reports[r]["kv_heads"] for r in range(TP)] == [1, 1]  # 2 KV heads over 2 ranks
    assert rank_reports[0]["capacity"] == rank_reports[1]["capacity"] == KV_TOKENS


def test_collectives_combine_every_rank(rank_reports):
    for r in range(TP):
        assert torch.equal(rank_reports[r]["gathered"], torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
        assert rank_reports[r]["min"] == 10


def test_parallel_linear_pair_with_bias_equals_the_full_layers(rank_reports):
    expected = biased_pair_output(TensorParallelGroup())
    for r in range(TP):
        torch.testing.assert_close(rank_reports[r]["pair"], expected, atol=ATOL, rtol=0)


def test_sharded_forward_gives_the_unsharded_logits(rank_reports, single_rank):
    reference = single_rank["logits"]
    for r in range(TP):
        assert rank_reports[r]["logits"].shape == reference.shape
        torch.testing.assert_close(rank_reports[r]["logits"], reference, atol=ATOL, rtol=0)
    # the all-reduce leaves identical bytes on every rank, so the ranks sample identically
    assert torch.equal(rank_reports[0]["logits"], rank_reports[1]["logits"])


def test_int8_ranks_quantize_their_own_shards_and_agree(rank_reports, single_rank):
    """Shard before quantizing: each rank's scales are its shard's, so tp=2 int8 is not bit-equal to tp=1,
    but it tracks the fp32 logits within int8 error, and the all-reduce keeps the ranks identical."""
    first = len(prompts())  # the first extend's rows; later steps feed back each run's own greedy tokens
    reference = single_rank["logits"][:first]
    int8 = rank_reports[0]["int8_logits"][:first]
    assert not torch.equal(int8, reference)
    assert ((int8 - reference).norm() / reference.norm()).item() < 0.05
    assert torch.equal(rank_reports[0]["int8_logits"], rank_reports[1]["int8_logits"])


def test_int8_ranks_calibrate_together_when_one_rank_lost_its_cache(rank_reports):
    for r in range(TP):
        assert rank_reports[r]["int8_cache_restored"]
        assert torch.equal(rank_reports[r]["int8_again_logits"], rank_reports[r]["int8_logits"])


def test_lockstep_schedulers_generate_what_one_rank_generates(rank_reports, single_rank):
    ranks = [rank_reports[r]["generated"] for r in range(TP)]
    assert ranks[0] == ranks[1]  # including the randomly sampled request: same draws on every rank
    expected = {rid: ids for rid, ids in single_rank["generated"].items() if rid != "sampled"}
    assert {rid: ranks[0][rid] for rid in expected} == expected
    assert all(len(ids) == 8 for ids in ranks[0].values())


def test_lockstep_schedulers_with_speculation_generate_what_one_rank_generates(rank_reports, single_rank):
    """NGRAM verify steps on every rank: the ranks agree (the sampled request included), and the greedy
    requests' tokens are those of one rank without speculation."""
    ranks = [rank_reports[r]["generated_speculative"] for r in range(TP)]
    assert rank_reports[0]["verify_steps"] == rank_reports[1]["verify_steps"] > 1
    assert ranks[0] == ranks[1]
    assert ranks[0] == single_rank["generated_speculative"]
    expected = {rid: ids for rid, ids in single_rank["generated"].items() if rid != "sampled"}
    assert {rid: ranks[0][rid] for rid in expected} == expected


def test_a_tp_size_that_does_not_divide_the_heads_is_rejected_before_loading(tiny_model_dir):
    with pytest.raises(ValueError, match="--tp-size 3 does not divide"):
        ModelRunner(tiny_model_dir, max_total_tokens=64, tp_size=3, dist_init_method="file:///nonexistent")
