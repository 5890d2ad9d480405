"""Adapters on the int8 CPU base: the fused decode step runs steps with adapter rows too, adding each layer's
adapter products after its kernel, with the bits of the module path (whose linear methods add them); the
int8 base with fp32 adapter matmuls (on factors stored in fp16) stays as close to transformers + PEFT in fp32
as the int8 base alone stays to transformers; an adapter whose factors fp16 cannot hold is refused."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from srt.lora.adapter import AdapterError
from srt.lora.lora_linear import KERNEL_POOL_DTYPE
from srt.lora.manager import LoRAConfig
from srt.model_executor.layers import cpu_kernels
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.models.cpu_decode import CpuDecodeStep
from test.unit.lora_adapters import peft_logits, save_peft_adapter
from test.unit.model_driver import PagedDriver, same_or_diverged_at_a_near_tie

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="srt's CPU kernels do not load here")

NAMES = [None, "r8", "r16_rslora", "r8"]
DECODE_STEPS = 8
# The int8 base alone is 0.05-0.09 off transformers' fp32 logits here, and the adapters' fp32 products read
# the same int8-rounded activations: an adapter row may be off by at most twice the worst base row (observed
# 1.3x). Skipping the adapter would be off by 3-4.
ADAPTER_ERROR_OVER_BASE = 2.0
# Greedy tokens may part from PEFT's only where PEFT's top two are within twice the error bound
NEAR_TIE = 0.3


@pytest.fixture(scope="module")
def runner(tiny_model_dir, tmp_path_factory) -> ModelRunner:
    out = tmp_path_factory.mktemp("lora_int8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SRT_CACHE_DIR", str(out / "int8_cache"))
        runner = ModelRunner(
            tiny_model_dir,
            max_total_tokens=1024,
            max_running_requests=8,
            device="cpu",
            quantization="w8a8_int8",
            lora=LoRAConfig(max_loras_per_batch=2, max_lora_rank=16),
        )
    runner.lora.load("r8", save_peft_adapter(tiny_model_dir, out / "r8", rank=8, seed=1))
    runner.lora.load(
        "r16_rslora",
        save_peft_adapter(tiny_model_dir, out / "r16", rank=16, seed=2, alpha=16, use_rslora=True),
    )
    return runner


@pytest.fixture
def driver(runner) -> PagedDriver:
    return PagedDriver.on_empty_pools(runner)


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(10, 5000) for _ in range(5 + 2 * i)] for i in range(len(NAMES))]


def fused_step_calls(runner: ModelRunner, step) -> int:
    """How many times the fused decode step ran during `step()`."""
    fused, calls = runner.model.cpu_decode, []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused, "hidden_states", lambda *a: calls.append(1) or type(fused).hidden_states(fused, *a))
        step()
    return len(calls)


def decode_and_verify(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a batch of the base and two adapters: a prefill, two decode steps, then a speculative verify
    step (three fed tokens a sequence, every row's logits)."""
    driver = PagedDriver.on_empty_pools(runner)
    seqs = [driver.new_seq(name) for name in NAMES[:3]]
    steps = [driver.extend(seqs, prompts()[:3])]
    for _ in range(2):
        steps.append(driver.decode(seqs, steps[-1].argmax(-1).tolist()))
    steps.append(driver.extend(seqs[:2], [[21, 22, 23], [31, 32, 33]], every_row=True))
    return steps


def test_the_fused_decode_step_adds_the_adapters_with_the_module_paths_bits(runner):
    """In its C layer loop (srt_decode_layers), from every layer's pool operands."""
    fused = runner.model.cpu_decode
    assert fused is not None, "the int8 CPU model has a fused decode step"
    steps: list[torch.Tensor] = []
    assert fused_step_calls(runner, lambda: steps.extend(decode_and_verify(runner))) == 3
    runner.model.cpu_decode = None  # the module path: each linear layer's method applies its adapters
    try:
        module_steps = decode_and_verify(runner)
    finally:
        runner.model.cpu_decode = fused
    assert all(torch.equal(a, b) for a, b in zip(steps, module_steps, strict=True))


def test_an_adapted_layer_whose_pool_the_kernels_cannot_read_sends_decode_through_the_modules(runner):
    """The C loop adds adapter products only from pools it reads by address; a layer whose adapters only its
    method can add must not be skipped, so such a model has no fused step."""
    method = runner.model.model.layers[1].mlp.down_proj.method
    assert CpuDecodeStep.refusal(runner.model, runner.model.kernels) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(method, "segment_args", lambda: None)
        reason = CpuDecodeStep.refusal(runner.model, runner.model.kernels)
    assert reason == "an adapted layer whose adapter pool the kernels do not read"


def test_the_int8_base_with_fp32_adapters_stays_within_int8_error_of_peft(tiny_model_dir, runner, driver):
    ps = prompts()
    seqs = [driver.new_seq(name) for name in NAMES]
    steps = [driver.extend(seqs, ps)]
    fed: list[list[int]] = [[] for _ in NAMES]
    for _ in range(DECODE_STEPS):
        tokens = steps[-1].argmax(-1).tolist()
        for history, token in zip(fed, tokens, strict=True):
            history.append(token)
        steps.append(driver.decode(seqs, tokens))
    errors, greedy_agrees = {}, []
    for i, name in enumerate(NAMES):
        path = None if name is None else runner.lora.adapters[name].path
        want = peft_logits(tiny_model_dir, path, ps[i] + fed[i])[len(ps[i]) - 1 :]
        got = torch.stack([step[i] for step in steps])
        errors[i] = (got - want).abs().max().item()
        # PEFT teacher-forced on srt's tokens: its argmax is its greedy choice up to the first difference
        top2 = want.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        greedy_agrees.append(
            same_or_diverged_at_a_near_tie(fed[i], want.argmax(-1).tolist()[:DECODE_STEPS], gaps, NEAR_TIE)
        )
    worst_base = max(err for i, err in errors.items() if NAMES[i] is None)
    for i, name in enumerate(NAMES):
        if name is not None:
            assert errors[i] <= ADAPTER_ERROR_OVER_BASE * worst_base, (name, errors[i], worst_base)
    assert sum(greedy_agrees) >= len(NAMES) // 2  # most rows decode PEFT's exact greedy tokens


def test_the_pool_holds_fp16_factors_and_refuses_an_adapter_fp16_cannot_hold(
    tiny_model_dir, runner, tmp_path
):
    assert {layer.a.dtype for layer in runner.lora.layers} == {KERNEL_POOL_DTYPE} == {torch.float16}
    path = save_peft_adapter(tiny_model_dir, tmp_path / "huge", rank=8, seed=3)
    tensors = load_file(f"{path}/adapter_model.safetensors")
    name = sorted(n for n in tensors if n.endswith("lora_A.weight"))[0]
    tensors[name].view(-1)[0] = 1e6  # finite in fp32, inf in fp16
    save_file(tensors, f"{path}/adapter_model.safetensors")
    with pytest.raises(AdapterError, match="beyond the adapter pool's torch.float16 range"):
        runner.lora.load("huge", path)
    assert "huge" not in runner.lora.loaded
