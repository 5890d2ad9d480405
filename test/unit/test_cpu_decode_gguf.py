"""The fused CPU decode step on a GGUF's own blocks (`cpu_decode.py` calling srt_gguf_linear on each layer's
`GGUFLinearMethod.block_parts`) is the module path without its Python: the same kernels on the same operands,
so the same logits (hence the same greedy tokens) and the same K/V, to the bit, for the embedded SmolLM2 and a
tiny random Llama in K-quants; for a batch past the int8 step's limit, a speculative verify step, and steps
with LoRA adapter rows."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.models.cpu_decode import LINEAR_GGUF
from srt.model_source import embedded_gguf_path
from test.unit.gguf_files import write_random_llama
from test.unit.model_driver import PagedDriver
from test.unit.test_cpu_decode import decode_step, run, verify

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="srt's CPU kernels do not load here")

SMOLLM2 = "smollm2-135m-instruct"
# a layer per K-quant (Q4_K_M files mix Q4_K and Q6_K in a layer's parts: each layer here is one type, and
# the fused q/k/v or gate/up parts of every layer go through the same table) and one of the simple types
K_QUANT_LAYERS = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0]
WIDE_BATCH = 16  # past the int8 step's 8 beside packed weights: the GGUF kernel takes every batch size


def smollm2() -> str:
    try:
        return embedded_gguf_path(SMOLLM2)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=["smollm2", "k-quants"])
def runner(request, tmp_path_factory) -> ModelRunner:
    path = smollm2()
    if request.param == "k-quants":
        path = write_random_llama(tmp_path_factory.mktemp("kq") / "kq.gguf", path, K_QUANT_LAYERS, seed=3)
    return ModelRunner(path, quantization="gguf", max_total_tokens=2048, max_running_requests=WIDE_BATCH)


def module_path(runner: ModelRunner, fn):
    """fn() with the fused step off: every op through its nn.Module and kernel wrapper."""
    lean = runner.model.cpu_decode
    runner.model.cpu_decode = None
    try:
        return fn()
    finally:
        runner.model.cpu_decode = lean


def test_every_linear_layer_runs_its_blocks_in_the_fused_step(runner):
    lean = runner.model.cpu_decode
    assert lean is not None, "a GGUF Llama decodes through the fused step"
    kinds = {lin.kind for layer in lean.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    assert kinds == {LINEAR_GGUF}
    assert lean.max_batch is None and lean.takes(decode_step(WIDE_BATCH))


def test_the_fused_step_gives_the_module_paths_bits(runner):
    lean_logits, lean_kv = run(runner)
    module_logits, module_kv = module_path(runner, lambda: run(runner))
    assert all(torch.equal(a, b) for a, b in zip(lean_logits, module_logits, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(lean_kv, module_kv, strict=True))
    assert not torch.equal(lean_logits[0], lean_logits[1])  # the steps decoded something


def wide_greedy(runner: ModelRunner) -> list[list[int]]:
    """WIDE_BATCH sequences of different lengths decoded together greedily: each step's tokens."""
    driver = PagedDriver.on_empty_pools(runner)
    seqs = [driver.new_seq() for _ in range(WIDE_BATCH)]
    logits = driver.extend(seqs, [[10 + 7 * i + j for j in range(2 + i % 5)] for i in range(WIDE_BATCH)])
    steps = []
    for _ in range(3):
        tokens = logits.argmax(-1).tolist()
        steps.append(tokens)
        logits = driver.decode(seqs, tokens)
    return steps + [logits.argmax(-1).tolist()]


def test_a_wide_batch_gives_the_module_paths_greedy_tokens(runner):
    assert wide_greedy(runner) == module_path(runner, lambda: wide_greedy(runner))


def test_a_verify_step_runs_fused_with_the_module_paths_bits(runner):
    fused_logits, fused_kv, fused_calls = verify(runner, fused=True)
    module_logits, module_kv, module_calls = verify(runner, fused=False)
    assert (fused_calls, module_calls) == (1, 0)
    assert torch.equal(fused_logits, module_logits)
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, module_kv, strict=True))


def test_adapter_rows_on_the_blocks_get_the_module_paths_bits(tmp_path):
    """A step of the base and two adapters on a K-quant file: the C loop adds each layer's adapter products
    after srt_gguf_linear (and its bias) as LoRA's method adds them after the GGUF method's product."""
    from srt.lora.manager import LoRAConfig
    from srt.model_executor.gguf_convert import convert
    from test.unit.lora_adapters import save_peft_adapter
    from test.unit.test_lora_int8 import decode_and_verify, fused_step_calls

    path = write_random_llama(tmp_path / "lora.gguf", smollm2(), [T.Q4_K, T.Q6_K], seed=11)
    convert(path, str(tmp_path / "converted"))  # the adapters' shapes come from a transformers checkpoint
    lora = LoRAConfig(max_loras_per_batch=2, max_lora_rank=16)
    runner = ModelRunner(path, quantization="gguf", max_total_tokens=1024, max_running_requests=8, lora=lora)
    runner.lora.load("r8", save_peft_adapter(str(tmp_path / "converted"), tmp_path / "r8", rank=8, seed=1))
    runner.lora.load(
        "r16_rslora",
        save_peft_adapter(
            str(tmp_path / "converted"), tmp_path / "r16", rank=16, seed=2, alpha=16, use_rslora=True
        ),
    )
    assert runner.model.cpu_decode is not None, "adapters on a GGUF base keep the fused step"
    steps: list[torch.Tensor] = []
    assert fused_step_calls(runner, lambda: steps.extend(decode_and_verify(runner))) == 3
    module_steps = module_path(runner, lambda: decode_and_verify(runner))
    assert all(torch.equal(a, b) for a, b in zip(steps, module_steps, strict=True))
