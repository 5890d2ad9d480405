"""Multi-LoRA in the scheduler (docs/lora.md), on the tiny random Llama with PEFT-made adapters: requests of
several adapters and of the base share steps and each gets the tokens it gets alone (PEFT's greedy tokens);
no step serves more adapters than the pool's slots; two adapters never share a cached prefix; adapters load
between steps and unload once their requests have finished, freeing their cache; requests for an adapter
that is not loaded are refused alone."""

from __future__ import annotations

import pytest
import torch

from srt.io_struct import LoadLoRAAdapterReq, UnloadLoRAAdapterReq
from srt.model_executor.model_runner import ModelRunner
from srt.scheduler.runner_builder import lora_config
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs
from test.unit.lora_adapters import base_model, save_peft_adapter
from test.unit.scheduler_driver import drive, greedy, request
from test.unit.test_scheduler import assert_pool_whole, prompts

MAX_NEW = 6


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("lora_sched")
    return {
        name: save_peft_adapter(tiny_model_dir, out / name, rank=8, seed=i) for i, name in enumerate("abc")
    }


def make(model_dir: str, adapters: dict[str, str], **flags) -> Scheduler:
    args = ServerArgs(
        **{
            "max_total_tokens": 2048,
            "max_running_requests": 8,
            "quantization": "none",
            "lora_paths": [f"{n}={p}" for n, p in adapters.items()],
            **flags,
        }
    )
    runner = ModelRunner(
        model_dir,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        quantization=args.quantization,
        lora=lora_config(args),
    )
    for name, path in adapters.items():
        runner.lora.load(name, path)
    return Scheduler(args, runner)


@torch.no_grad()
def peft_greedy(model_dir: str, adapter_dir: str | None, prompt: list[int]) -> list[int]:
    from peft import PeftModel

    model = base_model(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = list(prompt)
    for _ in range(MAX_NEW):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def lora_request(rid: str, prompt: list[int], adapter: str | None):
    req = request(rid, prompt, greedy(MAX_NEW))
    req.lora_name = adapter
    return req


CASES = [(f"r{i}", adapter) for i, adapter in enumerate([None, "a", "b", "c", "a", None])]


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters) -> dict[str, list[int]]:
    ps = prompts(len(CASES), seed=7)
    return {
        rid: peft_greedy(tiny_model_dir, adapters.get(a) if a else None, p)
        for (rid, a), p in zip(CASES, ps, strict=True)
    }


def record_steps(sched: Scheduler) -> list[set]:
    """The distinct adapters of every forward step."""
    steps: list[set] = []
    slots = sched.builder.adapter_slots

    def recording(reqs):
        steps.append({r.lora_name for r in reqs} - {None})
        return slots(reqs)

    sched.builder.adapter_slots = recording
    return steps


@pytest.mark.parametrize("slots", [3, 1])
def test_requests_of_several_adapters_share_steps_and_get_pefts_tokens(
    tiny_model_dir, adapters, expected, slots
):
    """With 3 slots the three adapters and the base run together; with 1 slot a step never serves two
    adapters (admission holds the others back) and everyone still gets PEFT's tokens."""
    sched = make(tiny_model_dir, adapters, max_loras_per_batch=slots)
    steps = record_steps(sched)
    reqs = [lora_request(rid, p, a) for (rid, a), p in zip(CASES, prompts(len(CASES), seed=7), strict=True)]
    res = drive(sched, {0: reqs[:3], 2: reqs[3:]})
    assert {rid: c.output_ids for rid, c in res.items()} == expected
    assert max(len(s) for s in steps) == min(slots, 3)
    assert_pool_whole(sched)


def test_two_adapters_never_share_a_cached_prefix(tiny_model_dir, adapters):
    sched = make(tiny_model_dir, adapters)
    prompt = prompts(1, low=40, high=40, seed=3)[0]
    first = drive(sched, {0: [lora_request("x", prompt, "a")]})["x"]
    other = drive(sched, {0: [lora_request("y", prompt, "b")]})["y"]
    base = drive(sched, {0: [lora_request("z", prompt, None)]})["z"]
    again = drive(sched, {0: [lora_request("w", prompt, "a")]})["w"]
    assert (first.cached_tokens, other.cached_tokens, base.cached_tokens) == (0, 0, 0)
    assert again.cached_tokens == len(prompt) - 1 and again.output_ids == first.output_ids
    assert len({tuple(c.output_ids) for c in (first, other, base)}) == 3  # the adapters change the answer


def test_an_adapter_loads_between_steps_and_unloads_after_its_requests(tiny_model_dir, adapters, expected):
    """Loaded by message (its files read on a worker thread) while a base request decodes; unloaded while
    its own request runs: that request finishes with its tokens, the reply waits for it, a later request
    for it is refused alone, and its cached prefix is freed."""
    sched = make(tiny_model_dir, {k: v for k, v in adapters.items() if k != "c"})
    ps = prompts(len(CASES), seed=7)
    sched.handle(LoadLoRAAdapterReq("load-c", "c", adapters["c"]))
    replies = []

    def on_step(step, s):
        replies.extend(s.take_replies())
        if step == 1:  # let the worker thread finish reading before "c"'s request arrives at step 3
            for _, future in s.lora._loading:
                future.result(timeout=60)
        if step == 4:
            s.handle(UnloadLoRAAdapterReq("unload-c", "c"))

    res = drive(sched, {0: [lora_request("r0", ps[0], None)], 3: [lora_request("r3", ps[3], "c")]}, on_step)
    assert res["r3"].output_ids == expected["r3"] and res["r0"].output_ids == expected["r0"]
    while sched.lora.busy:
        sched.step()
        replies.extend(sched.take_replies())
    assert [(r.request_id, r.success) for r in replies] == [("load-c", True), ("unload-c", True)]
    assert "c" not in sched.runner.lora.loaded and "c" not in sched.tree_cache.roots
    refused = drive(sched, {0: [lora_request("late", ps[3], "c"), lora_request("ok", ps[1], "a")]})
    assert refused["late"].finish.type == "error" and "not loaded" in refused["late"].finish.message
    assert refused["ok"].output_ids == expected["r1"]
    assert_pool_whole(sched)


def test_bad_load_and_unload_messages_get_failed_replies(tiny_model_dir, adapters, tmp_path):
    sched = make(tiny_model_dir, {"a": adapters["a"]})
    sched.handle(LoadLoRAAdapterReq("1", "a", adapters["b"]))  # the name is taken
    sched.handle(LoadLoRAAdapterReq("2", "new", str(tmp_path / "missing")))
    sched.handle(LoadLoRAAdapterReq("3", "bad:name", adapters["b"]))
    sched.handle(UnloadLoRAAdapterReq("4", "never-loaded"))
    while sched.lora.busy:
        sched.step()
    replies = {r.request_id: r for r in sched.take_replies()}
    assert not any(r.success for r in replies.values())
    assert "already loaded" in replies["1"].message and "missing" in replies["2"].message
    assert "':'" in replies["3"].message and "not loaded" in replies["4"].message
    assert all("\n" not in r.message for r in replies.values())
    assert sched.runner.lora.loaded == ["a"]


def test_the_load_snapshot_names_an_adapter_only_while_its_requests_run_or_wait(tiny_model_dir, adapters):
    """What the LoRA metrics read: "a" runs from the first step, "b" waits while one slot holds "a", then
    runs; when everything has finished neither is listed, and both stay loaded."""
    sched = make(tiny_model_dir, adapters, max_loras_per_batch=1)
    ps = prompts(2, seed=11)
    seen = []
    drive(
        sched,
        {0: [lora_request("x", ps[0], "a"), lora_request("y", ps[1], "b")]},
        on_step=lambda step, s: seen.append((s.load().lora.running, s.load().lora.waiting)),
    )
    assert seen[0] == (("a",), ("b",))
    assert (("b",), ()) in seen
    final = sched.load().lora
    assert (final.running, final.waiting) == ((), ())
    assert {name for name, _ in final.loaded} == set(adapters) and final.slots_total == 1


@pytest.mark.parametrize("as_decode_rows", [False, True], ids=["extend", "decode_rows"])
def test_verify_steps_apply_each_requests_adapter_to_its_drafts(
    tiny_model_dir, adapters, expected, as_decode_rows
):
    """Requests of three adapters and the base, each predicting its own answer, verify their drafts in shared
    steps: every fed row goes through its request's adapter, in the extend layout and in the decode-row
    layout a GPU's graphs replay (`StepBuilder.verify_rows_as_decode`), and everyone gets PEFT's tokens."""
    sched = make(
        tiny_model_dir, adapters, max_loras_per_batch=3, disable_mixed_chunk=True
    )  # no prefill beside
    sched.builder.verify_rows_as_decode = 64 if as_decode_rows else 0
    accepted, layouts = [], []
    sched.reporter.on_verify = lambda step: accepted.append(step.num_accepted_tokens)
    verify = sched.builder.verify

    def recording(*args, **kwargs):
        batch = verify(*args, **kwargs)
        layouts.append((batch.is_decode, batch.has_adapters))
        return batch

    sched.builder.verify = recording
    reqs = [lora_request(rid, p, a) for (rid, a), p in zip(CASES, prompts(len(CASES), seed=7), strict=True)]
    for req in reqs:
        req.prediction_ids = expected[req.rid]
    res = drive(sched, {0: reqs[:3], 1: reqs[3:]})
    assert {rid: c.output_ids for rid, c in res.items()} == expected
    assert sum(accepted) > 0
    assert any(has_adapters for _, has_adapters in layouts)
    assert all(is_decode == as_decode_rows for is_decode, _ in layouts)
    assert_pool_whole(sched)
