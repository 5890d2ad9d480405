"""The scheduler's equivalences on a GPU (skipped without CUDA): with the runner on CUDA (the Triton
backend, decode replayed from CUDA graphs), a greedy request's tokens do not depend on batching, on a
prefix-cache hit, on chunked prefill or on retraction; seeded sampling runs on the device and is
reproducible; CUDA graphs and mixed prefill/decode steps change no token; and the pools are whole
afterwards."""

from __future__ import annotations

import pytest

from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import assert_pool_whole, prompts

pytestmark = pytest.mark.cuda


def make_scheduler(model_dir: str, **overrides) -> Scheduler:
    """fp32 on the GPU: greedy equivalences compare exact tokens, which bf16's rounding can tie-break."""
    args = ServerArgs(
        **{"max_total_tokens": 4096, "max_running_requests": 16, "device": "cuda", "dtype": "float32",
           **overrides}
    )  # fmt: skip
    runner = ModelRunner(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        cuda_graph_max_bs=0 if args.disable_cuda_graph else args.cuda_graph_max_bs,
    )
    return Scheduler(args, runner)


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir)
    refs = {}
    for i, p in enumerate(prompts(6)):
        refs[f"r{i}"] = drive(sched, {0: [request(f"r{i}", p, greedy(12))]})[f"r{i}"].output_ids
        sched.flush_cache()
    return refs


def staggered(ps):
    return {
        0: [request("r0", ps[0], greedy(12)), request("r1", ps[1], greedy(12))],
        3: [request("r2", ps[2], greedy(12))],
        5: [request("r3", ps[3], greedy(12)), request("r4", ps[4], greedy(12))],
        9: [request("r5", ps[5], greedy(12))],
    }


@pytest.mark.parametrize(
    "graphs, mixed", [(True, False), (False, False), (True, True)], ids=["cuda_graph", "eager", "mixed_chunk"]
)
def test_continuous_batching_matches_running_alone(tiny_model_dir, alone, graphs, mixed):
    """Mixed steps (off by default on a GPU) run their decoding tail through the extend kernel."""
    sched = make_scheduler(tiny_model_dir, disable_cuda_graph=not graphs, enable_mixed_chunk=mixed)
    assert (sched.runner.cuda_graph is not None) == graphs and (sched.mixed_budget is not None) == mixed
    res = drive(sched, staggered(prompts(6)))
    for rid, ref in alone.items():
        assert res[rid].output_ids == ref, rid
    assert_pool_whole(sched)


def test_chunked_prefill_and_prefix_hit_give_the_same_tokens(tiny_model_dir):
    shared = prompts(1, low=150, high=150, seed=3)[0]
    cold = drive(
        make_scheduler(tiny_model_dir, chunked_prefill_size=-1, disable_radix_cache=True),
        {0: [request("a", shared, greedy(8))]},
    )
    sched = make_scheduler(tiny_model_dir, chunked_prefill_size=32)
    chunked = drive(sched, {0: [request("b", shared, greedy(8))]})
    hit = drive(sched, {0: [request("c", shared, greedy(8))]})
    assert hit["c"].cached_tokens == len(shared) - 1
    assert cold["a"].output_ids == chunked["b"].output_ids == hit["c"].output_ids
    assert_pool_whole(sched)


def test_retraction_resumes_with_identical_output(tiny_model_dir):
    ps = prompts(8, low=30, high=30, seed=7)
    ref_sched = make_scheduler(tiny_model_dir)
    refs = {
        f"r{i}": drive(ref_sched, {0: [request(f"r{i}", p, greedy(40))]})[f"r{i}"].output_ids
        for i, p in enumerate(ps)
    }
    sched = make_scheduler(tiny_model_dir, max_total_tokens=300)
    res = drive(sched, {0: [request(f"r{i}", p, greedy(40)) for i, p in enumerate(ps)]})
    assert sum(r.num_retractions for r in res.values()) > 0
    for rid, ref in refs.items():
        assert res[rid].output_ids == ref, rid
    assert_pool_whole(sched)


def test_seeded_sampling_runs_on_the_device_and_repeats(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir)
    assert sched.intake.default_generator.device.type == "cuda"
    ps = prompts(3, seed=9)

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)

    alone = drive(sched, {0: [request("x", ps[0], sampled(5))]})["x"].output_ids
    batched = drive(
        sched,
        {
            0: [
                request("y", ps[0], sampled(5)),
                request("z", ps[1], sampled(6)),
                request("w", ps[2], greedy(16)),
            ]
        },
    )
    other_seed = drive(sched, {0: [request("v", ps[0], sampled(7))]})["v"].output_ids
    assert batched["y"].output_ids == alone
    assert other_seed != alone


def test_every_sampling_parameter_runs_on_the_device(tiny_model_dir):
    """Penalties, logit bias, min_new_tokens, top-k/min-p, logprobs and prompt logprobs in one batch."""
    sched = make_scheduler(tiny_model_dir)
    ps = prompts(6, seed=13)
    favoured = 1234
    params = {
        "pen": SamplingParams(max_new_tokens=8, temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5,
                              presence_penalty=0.5, seed=1, ignore_eos=True),
        "bias": SamplingParams(max_new_tokens=8, temperature=0, logit_bias={favoured: 100.0}, ignore_eos=True),
        "min": SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=0),
        "topk": SamplingParams(max_new_tokens=8, temperature=1.0, top_k=5, min_p=0.05, seed=2, ignore_eos=True),
        "lp": SamplingParams(max_new_tokens=8, temperature=0, logprobs=3, ignore_eos=True),
        "prompt_lp": SamplingParams(max_new_tokens=2, temperature=0, logprob_start_len=0, ignore_eos=True),
    }  # fmt: skip
    res = drive(sched, {0: [request(rid, ps[i], p) for i, (rid, p) in enumerate(params.items())]})
    assert res["bias"].output_ids == [favoured] * 8
    assert len(res["min"].output_ids) == 8
    for rid, p in params.items():
        assert res[rid].finish.type == "length", rid
        assert len(res[rid].output_ids) == p.max_new_tokens, rid
    assert_pool_whole(sched)


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE", "prediction"])
def test_speculative_decoding_gives_the_tokens_of_plain_decoding(tiny_model_dir, alone, algorithm):
    """Verify steps laid out as decode rows replay the decode graphs (`StepBuilder.verify_rows_as_decode`)
    next to graphed decode steps: NGRAM, the model drafting for itself, and predictions (the answer itself)
    give every request its tokens alone, with drafts accepted and the pools whole."""
    from srt.speculative.stats import SpecStepStats

    spec = {
        "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1},
        "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": tiny_model_dir},
        "prediction": {},
    }[algorithm]
    sched = make_scheduler(tiny_model_dir, **spec)
    steps: list[SpecStepStats] = []
    sched.reporter.on_verify = steps.append
    verify, layouts = sched.builder.verify, []

    def recording(*args, **kwargs):
        batch = verify(*args, **kwargs)
        layouts.append(batch.is_decode and sched.runner.cuda_graph.can_run(batch))
        return batch

    sched.builder.verify = recording
    reqs = [request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts(6))]
    if algorithm == "prediction":
        for req in reqs:
            req.prediction_ids = alone[req.rid]
    res = drive(sched, {0: reqs[:3], 4: reqs[3:]})
    for rid, ref in alone.items():
        assert res[rid].output_ids == ref, rid
    assert sum(s.num_accepted_tokens for s in steps) > 0
    assert any(layouts), "no verify step replayed a decode graph"
    assert_pool_whole(sched)
