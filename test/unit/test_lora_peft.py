"""One batch, many adapters, exact against PEFT: on the tiny Llama in fp32, a step mixing base rows with rows of
three adapters (ranks 8 and 16 on all seven target modules, one with rsLoRA's scaling, one on q_proj and
v_proj only) gives every row the logits transformers + PEFT give that sequence with its own adapter (the
base rows: the plain model's), in extend, decode and mixed steps."""

from __future__ import annotations

import random

import pytest
import torch

from srt.lora.adapter import lora_scaling
from srt.lora.manager import LoRAConfig
from srt.model_executor.forward_batch_info import ForwardMode, FreshTensors, lay_out
from srt.model_executor.model_runner import ModelRunner
from test.model_families import gemma2
from test.unit.lora_adapters import peft_logits, save_peft_adapter
from test.unit.model_driver import PagedDriver

ATOL = 1e-4  # fp32 on both sides: only the summation order differs (observed: ~3e-6)
# an adapter must move the logits far beyond ATOL, or agreeing with PEFT would say nothing
MIN_ADAPTER_EFFECT = 0.5
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("lora_peft")
    return {
        "r8": save_peft_adapter(tiny_model_dir, out / "r8", rank=8, seed=1),
        "r16_rslora": save_peft_adapter(
            tiny_model_dir, out / "r16", rank=16, seed=2, alpha=16, use_rslora=True
        ),
        "r8_qv": save_peft_adapter(tiny_model_dir, out / "qv", rank=8, seed=3, targets=("q_proj", "v_proj")),
    }


@pytest.fixture(scope="module")
def runner(tiny_model_dir, adapters) -> ModelRunner:
    runner = ModelRunner(
        tiny_model_dir,
        max_total_tokens=2048,
        max_running_requests=8,
        device="cpu",
        quantization="none",
        lora=LoRAConfig(max_loras_per_batch=3, max_lora_rank=16),
    )
    for name, path in adapters.items():
        runner.lora.load(name, path)
    return runner


@pytest.fixture
def driver(runner) -> PagedDriver:
    return PagedDriver.on_empty_pools(runner)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 5000) for _ in range(n)]


def reference(tiny_model_dir, adapters, adapter: str | None, ids: list[int]) -> torch.Tensor:
    return peft_logits(tiny_model_dir, None if adapter is None else adapters[adapter], ids)


def test_a_batch_of_the_base_and_three_adapters_gives_each_row_its_peft_logits(
    tiny_model_dir, adapters, driver
):
    # adapters interleaved with the base and with each other, so the step's rows must be regrouped
    names = [None, "r8", "r16_rslora", "r8", None, "r8_qv", "r16_rslora"]
    prompts = [tokens(4 + 2 * i, seed=i) for i in range(len(names))]
    fed = [tokens(DECODE_STEPS, seed=100 + i) for i in range(len(names))]
    seqs = [driver.new_seq(name) for name in names]
    steps = [driver.extend(seqs, prompts)]
    for j in range(DECODE_STEPS):
        steps.append(driver.decode(seqs, [f[j] for f in fed]))
    for i, name in enumerate(names):
        want = reference(tiny_model_dir, adapters, name, prompts[i] + fed[i])
        got = torch.stack([step[i] for step in steps])
        torch.testing.assert_close(got, want[len(prompts[i]) - 1 :], atol=ATOL, rtol=0)
        if name is not None:
            base = reference(tiny_model_dir, adapters, None, prompts[i] + fed[i])
            assert (want - base).abs().max() > MIN_ADAPTER_EFFECT


def test_a_mixed_step_adapts_its_prefill_and_decode_rows_alike(tiny_model_dir, adapters, driver):
    """A prefill chunk of one adapter riding along with the decode rows of others (and of the base)."""
    decoding = [None, "r16_rslora", "r8"]
    prompts = [tokens(6, seed=20 + i) for i in range(len(decoding))]
    seqs = [driver.new_seq(name) for name in decoding]
    driver.extend(seqs, prompts)
    newcomer, new_prompt, fed = driver.new_seq("r8_qv"), tokens(9, seed=30), tokens(3, seed=31)
    logits = driver.mixed([newcomer], [new_prompt], seqs, fed)
    torch.testing.assert_close(
        logits[0], reference(tiny_model_dir, adapters, "r8_qv", new_prompt)[-1], atol=ATOL, rtol=0
    )
    for i, name in enumerate(decoding):
        want = reference(tiny_model_dir, adapters, name, prompts[i] + [fed[i]])[-1]
        torch.testing.assert_close(logits[1 + i], want, atol=ATOL, rtol=0)


def test_a_batch_of_one_adapter_expands_in_place_and_gives_peft_logits(tiny_model_dir, adapters, driver):
    """Every row of one adapter: the layers skip the gather and scatter of a mixed batch."""
    prompts = [tokens(5, seed=50), tokens(8, seed=51)]
    seqs = [driver.new_seq("r16_rslora") for _ in prompts]
    steps = [driver.extend(seqs, prompts), driver.decode(seqs, [7, 9])]
    assert driver.runner.lora.step.info.order is None
    for i, fed in enumerate([7, 9]):
        want = reference(tiny_model_dir, adapters, "r16_rslora", prompts[i] + [fed])[-2:]
        torch.testing.assert_close(torch.stack([step[i] for step in steps]), want, atol=ATOL, rtol=0)


def test_prompt_logprobs_are_the_adapters(tiny_model_dir, adapters, runner):
    """The runner's prompt-logprob path (a prefill scoring every prompt token) adapts its rows too."""
    ids = tokens(10, seed=60)
    n = len(ids)
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    slots, row = runner.token_to_kv_pool_allocator.alloc(n), runner.req_to_token_pool.alloc(1)[0]
    batch = lay_out(
        ForwardMode.EXTEND,
        runner.req_to_token_pool,
        [row],
        [0],
        ids,
        [n],
        slots,
        FreshTensors(runner.device),
        logprob_rows=torch.arange(n - 1),
        logprob_targets=torch.tensor(ids[1:]),
        lora_slots=runner.lora.prepare_step(["r8"]),
    )
    _, scores = runner.forward_with_prompt_logprobs(batch)
    want = torch.log_softmax(reference(tiny_model_dir, adapters, "r8", ids)[:-1], dim=-1)
    torch.testing.assert_close(
        scores.token_logprobs, want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=ATOL, rtol=0
    )


def test_a_step_of_the_base_alone_is_the_plain_model(tiny_model_dir, driver):
    ids = tokens(12, seed=40)
    logits = driver.extend([driver.new_seq()], [ids])
    torch.testing.assert_close(logits[0], peft_logits(tiny_model_dir, None, ids)[-1], atol=ATOL, rtol=0)


def test_a_family_with_its_own_layer_classes_is_adapted_alike(tmp_path):
    """Adapted layers are found by their checkpoint module names: Gemma 2's layers (its own attention and
    GeGLU MLP, sliding windows, soft-capping) take adapters as the Llama's do."""
    config, model_class = gemma2()
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model_dir = str(tmp_path / "gemma2")
    model_class._from_config(config).to(torch.float32).save_pretrained(model_dir)
    adapter = save_peft_adapter(model_dir, tmp_path / "adapter", rank=8, seed=5)
    runner = ModelRunner(
        model_dir,
        max_total_tokens=256,
        max_running_requests=2,
        device="cpu",
        quantization="none",
        lora=LoRAConfig(max_lora_rank=8),
    )
    runner.lora.load("gemma-adapter", adapter)
    driver = PagedDriver(runner)
    prompts = [list(range(5, 17)), [20, 21, 22]]  # the first longer than the sliding window
    logits = driver.extend([driver.new_seq("gemma-adapter"), driver.new_seq()], prompts)
    for row, (prompt, path) in enumerate(zip(prompts, [adapter, None], strict=True)):
        torch.testing.assert_close(logits[row], peft_logits(model_dir, path, prompt)[-1], atol=ATOL, rtol=0)


def test_scaling_is_alpha_over_rank_or_over_its_square_root_with_rslora(runner):
    assert lora_scaling({"r": 16, "lora_alpha": 16}) == 1.0
    assert lora_scaling({"r": 16, "lora_alpha": 16, "use_rslora": True}) == 4.0
    assert runner.lora.adapters["r8"].scaling == 2.0  # PEFT-made with lora_alpha = 2 r
    assert runner.lora.adapters["r16_rslora"].scaling == 4.0


def test_decode_steps_of_one_layout_share_one_batch_info_and_another_layout_gets_its_own(
    tiny_model_dir, adapters, driver
):
    """The rows-by-adapter layout is worked out once while the step's sequences, slots and ranks repeat
    (decode after decode), and again when they change; a step served the kept layout is still PEFT's."""
    prompts = [tokens(5, seed=60), tokens(6, seed=61)]
    seqs = [driver.new_seq("r8"), driver.new_seq("r16_rslora")]
    driver.extend(seqs, prompts)
    driver.decode(seqs, [3, 4])
    first = driver.runner.lora.step.info
    logits = driver.decode(seqs, [5, 6])
    assert driver.runner.lora.step.info is first
    driver.decode(seqs[:1], [7])
    alone = driver.runner.lora.step.info
    assert alone is not first and [s.rank for s in alone.segments] == [8]
    for i, fed in enumerate([[3, 5], [4, 6]]):
        name = ("r8", "r16_rslora")[i]
        want = reference(tiny_model_dir, adapters, name, prompts[i] + fed)[-1]
        torch.testing.assert_close(logits[i], want, atol=ATOL, rtol=0)
