"""The int8 CPU model's lean decode step (`cpu_decode.py`: one kernel call per operation) is the module
path without its Python: the same logits and the same K/V in the pool, to the bit, step after step, for a
batch of sequences of different lengths, with an fp16 or an fp32 KV cache, and with biased projections."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.models.cpu_decode import EXTEND_MAX_TOKENS
from test.conftest import TINY_LLAMA, assets_config, copy_tokenizer
from test.unit.model_driver import PagedDriver

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="srt's CPU kernels do not load here")

PROMPTS = [[random.Random(i).randrange(10, 5000) for _ in range(n)] for i, n in enumerate((5, 23, 9))]
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def biased_model_dir(model_assets_dir, tmp_path_factory) -> str:
    """The tiny Llama with biases on every projection (q/k/v/o and the MLP), random, not zero: the fused
    step's linear layers then read a bias too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {**TINY_LLAMA, "vocab_size": assets_config(model_assets_dir)["vocab_size"]}
    config = LlamaConfig(**fields, attention_bias=True, mlp_bias=True, architectures=["LlamaForCausalLM"])
    torch.manual_seed(5)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    out = tmp_path_factory.mktemp("tiny_biased")
    model.save_pretrained(out, safe_serialization=True)
    return copy_tokenizer(model_assets_dir, out)


@pytest.fixture(
    scope="module",
    params=[("float16", "tiny"), ("float32", "tiny"), ("float16", "biased")],
    ids=["float16", "float32", "float16-biases"],
)
def runner(request, tmp_path_factory) -> ModelRunner:
    kv_dtype, model = request.param
    model_dir = request.getfixturevalue("tiny_model_dir" if model == "tiny" else "biased_model_dir")
    mp = pytest.MonkeyPatch()
    mp.setenv("SRT_CACHE_DIR", str(tmp_path_factory.mktemp("int8_cache")))
    runner = ModelRunner(
        model_dir,
        max_total_tokens=2048,
        max_running_requests=8,
        quantization="w8a8_int8",
        kv_cache_dtype=kv_dtype,
    )
    mp.undo()
    return runner


def decode_step(bs: int) -> SimpleNamespace:
    """What `CpuDecodeStep.takes` reads of a decode step of bs sequences."""
    return SimpleNamespace(is_decode=True, num_tokens=bs)


def run(runner: ModelRunner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill the prompts, then decode them together (each step feeding its greedy tokens): every decode
    step's logits, and every layer's K and V pool rows of the sequences' slots at the end."""
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    driver = PagedDriver(runner)
    seqs = [driver.new_seq() for _ in PROMPTS]
    logits = driver.extend(seqs, PROMPTS)
    steps = []
    for _ in range(DECODE_STEPS):
        logits = driver.decode(seqs, logits.argmax(-1).tolist())
        steps.append(logits)
    slots = torch.cat([s for seq in seqs for s in seq.owned_slots])
    pool = runner.token_to_kv_pool
    kv = [buf[slots].clone() for i in range(len(runner.model.model.layers)) for buf in pool.get_kv_buffer(i)]
    return steps, kv


def test_the_lean_decode_step_gives_the_module_paths_bits(runner):
    model = runner.model
    lean = model.cpu_decode
    assert lean is not None and lean.takes(decode_step(len(PROMPTS))), "the int8 CPU model decodes through it"
    lean_logits, lean_kv = run(runner)
    model.cpu_decode = None  # the module path: every op through its nn.Module and kernel wrapper
    try:
        module_logits, module_kv = run(runner)
    finally:
        model.cpu_decode = lean
    assert all(torch.equal(a, b) for a, b in zip(lean_logits, module_logits, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(lean_kv, module_kv, strict=True))
    assert not torch.equal(lean_logits[0], lean_logits[1])  # the steps decoded something


@pytest.mark.parametrize("batch", [1, 8, 9, 64])
def test_the_lean_step_takes_a_batch_only_where_the_fused_kernel_takes_every_linear_layer(runner, batch):
    """The lean step runs every linear layer through the fused kernel, so it must not take a batch size for
    which the module path would have chosen a faster library kernel (packed oneDNN, or `_int_mm` with
    VNNI): same bits either way, but the wrong kernel is up to 2x slower."""
    from srt.model_executor.quantization import quantizable_layers

    kernels = cpu_kernels.load()
    weights = [m.method.int8_weight() for name, m in quantizable_layers(runner.model) if name != "lm_head"]
    fused_everywhere = all(
        w.weight is not None and kernels.takes_linear(batch, w.weight.shape[1], w.packed is not None)
        for w in weights
    )
    assert runner.model.cpu_decode.takes(decode_step(batch)) == fused_everywhere


FED = [PROMPTS[0][-3:] + [7, 8], PROMPTS[1][-3:]]  # each sequence's newest token and drafts: 8 rows


def verify(runner: ModelRunner, fused: bool) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """A speculative verify step as the scheduler lays it out: two sequences with cached prompts, each
    feeding several tokens at once with logits for every row; with `fused` off, through the modules. Also
    how many times the lean step ran."""
    model = runner.model
    lean = model.cpu_decode
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    driver = PagedDriver(runner)
    seqs = [driver.new_seq() for _ in FED]
    driver.extend(seqs, [p[:-3] for p in PROMPTS[:2]])
    calls = []
    model.cpu_decode = lean if fused else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lean, "hidden_states", lambda *a: calls.append(1) or type(lean).hidden_states(lean, *a))
        try:
            logits = driver.extend(seqs, FED, every_row=True)
        finally:
            model.cpu_decode = lean
    slots = torch.cat([seq.owned_slots[-1] for seq in seqs])
    pool = runner.token_to_kv_pool
    kv = [buf[slots].clone() for i in range(len(model.model.layers)) for buf in pool.get_kv_buffer(i)]
    return logits, kv, len(calls)


def one_token_at_a_time(runner: ModelRunner) -> torch.Tensor:
    """The reference for a verify step's rows: each sequence decoding its fed tokens one step at a time."""
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    driver = PagedDriver(runner)
    rows = []
    for prompt, fed in zip(PROMPTS[:2], FED, strict=True):
        seq = driver.new_seq()
        driver.extend([seq], [prompt[:-3]])
        rows.extend(driver.decode([seq], [token]) for token in fed)
    return torch.cat(rows)


def test_a_verify_step_of_a_few_tokens_runs_as_decode_rows_with_the_module_paths_bits(runner):
    """A verify step (newest token + drafts over a cached prefix, logits for every row) of no more tokens
    than the fused kernel takes runs through the lean step, each fed token a decode row attending to its
    own sequence's slots up to itself: the extend path's bits and K/V, and each row what decoding the
    tokens one by one gives (causal within the step)."""
    lean = runner.model.cpu_decode
    most = min(EXTEND_MAX_TOKENS, lean.max_batch or EXTEND_MAX_TOKENS)
    assert lean.takes(SimpleNamespace(is_decode=False, num_tokens=most))
    assert not lean.takes(SimpleNamespace(is_decode=False, num_tokens=most + 1))
    fused_logits, fused_kv, fused_calls = verify(runner, fused=True)
    module_logits, module_kv, module_calls = verify(runner, fused=False)
    assert (fused_calls, module_calls) == (1, 0)
    assert fused_logits.shape[0] == 8
    assert torch.equal(fused_logits, module_logits)
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, module_kv, strict=True))
    assert torch.equal(fused_logits, one_token_at_a_time(runner))


def growing_then_shrinking(runner: ModelRunner) -> list[torch.Tensor]:
    """Decode steps of 1, then 3, then 1 sequence (the first alone, then beside the two others): each
    step's logits."""
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    driver = PagedDriver(runner)
    seqs = [driver.new_seq() for _ in PROMPTS]
    driver.extend(seqs, PROMPTS)
    return [
        driver.decode(seqs[:1], [11]),
        driver.decode(seqs, [12, 13, 14]),
        driver.decode(seqs[:1], [15]),
    ]


def test_the_steps_working_rows_are_kept_across_steps_and_grown_only_for_a_larger_one(runner):
    """No step allocates its working rows: a step reuses the largest step's buffers (the same addresses)
    and a larger step grows them; every step still gives the module path's bits."""
    model = runner.model
    lean = model.cpu_decode
    lean._scratch = None
    seen = []
    real = lean._scratch_for

    def recording(m):
        pointers = real(m)
        seen.append((m, lean._scratch.rows, lean._scratch.pointers[0]))
        return pointers

    lean._scratch_for = recording
    try:
        lean_logits = growing_then_shrinking(runner)
    finally:
        del lean._scratch_for
    (m1, rows1, at1), (m3, rows3, at3), (m1b, rows1b, at1b) = seen
    assert (m1, m3, m1b) == (1, 3, 1)
    assert rows1 == 1 and rows3 >= 3 and at3 != at1  # grown for the larger step
    assert rows1b == rows3 and at1b == at3  # kept for the smaller one
    model.cpu_decode = None
    try:
        module_logits = growing_then_shrinking(runner)
    finally:
        model.cpu_decode = lean
    assert all(torch.equal(a, b) for a, b in zip(lean_logits, module_logits, strict=True))
