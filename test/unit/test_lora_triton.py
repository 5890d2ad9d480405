"""The triton LoRA kernels equal `LayerLoRAWeights.add_delta`'s PyTorch path: fused (unequal q, k, v) and
plain layers, adapters of different ranks in one step, rows in place or gathered through a shuffled `order`
(rows left out stay bit-identical), segments shorter and longer than a row block, a strided `x`, fp32 and
16-bit pools; the pool's padding beyond each adapter's rank is never read; a runner on `--lora-backend
triton` decodes what `torch_native` does. On a CPU the kernels run under Triton's interpreter
(test/unit/triton_interpreter.py); `cuda`-marked tests check realistic shapes."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from test.unit.triton_interpreter import (
    BF16_UNSUPPORTED,
    interpreted_imports,
    interpreter_while_testing,  # noqa: F401 (autouse)
)

with interpreted_imports():
    from srt.lora import triton_lora
    from srt.lora.batch_info import LoRABatchInfo, Segment
    from srt.lora.lora_linear import LayerLoRAWeights, SubModule
    from srt.lora.manager import LoRAConfig
    from srt.model_executor.model_runner import ModelRunner
    from test.unit.lora_adapters import save_peft_adapter
    from test.unit.model_driver import PagedDriver


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_ATOL = 1e-5  # kernels and reference differ only in summation order
# the reference rounds the shrunk rows and each sub-module's delta to the 16-bit type before adding them to
# `out`; the kernels keep both in fp32 and round once, so they differ by a few of the type's ulps of O(1)
REDUCED_ATOL = {torch.float16: 1e-2, torch.bfloat16: 6e-2}
SLOTS, MAX_RANK = 4, 16


class Layer(NamedTuple):
    subs: tuple[tuple[int, int], ...]  # each sub-module's (first output column, width)
    out_features: int
    in_features: int


# q 64, k 32, v 32: the second 64-column output block holds both k and v; 80 inputs, the second 64-wide chunk
# masked
FUSED = Layer(((0, 64), (64, 32), (96, 32)), 128, 80)
PLAIN = Layer(((0, 48),), 48, 40)
GAPPED = Layer(((0, 40), (72, 40)), 128, 40)  # columns 40..72 and 112..128 belong to no sub-module
# (slot, rank, rows): one row, three, and seventeen (more than a 16-row block), ranks 8 and 16
SEGMENTS = ((2, 16, 17), (0, 8, 1), (3, 8, 3))


def layer_weights(layer: Layer, dtype, seed, padding=0.0) -> LayerLoRAWeights:
    """A pool with random adapters in the slots SEGMENTS use; `padding` everywhere else (beyond each one's
    rank, unused slots, B's columns outside every sub-module)."""
    subs = tuple(SubModule(f"sub{i}", i, offset, size, size) for i, (offset, size) in enumerate(layer.subs))
    weights = LayerLoRAWeights(
        subs, layer.in_features, layer.out_features, None, 0, SLOTS, MAX_RANK, dtype, DEVICE, kernels=None
    )
    gen = torch.Generator().manual_seed(seed)
    weights.a.fill_(padding)
    weights.b.fill_(padding)
    for slot, rank, _ in SEGMENTS:
        a = torch.randn(len(subs) * rank, layer.in_features, generator=gen) / layer.in_features**0.5
        weights.a[slot, : len(subs) * rank] = a.to(dtype)
        for offset, size in layer.subs:
            b = torch.randn(rank, size, generator=gen) / rank**0.5
            weights.b[slot, :rank, offset : offset + size] = b.to(dtype)
    return weights


def inputs(layer: Layer, total: int, dtype, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """x and the base output `out`, random."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(total, layer.in_features, generator=gen).to(DEVICE, dtype)
    return x, torch.randn(total, layer.out_features, generator=gen).to(DEVICE, dtype)


def info_of(order: torch.Tensor | None, segments: tuple[Segment, ...]) -> LoRABatchInfo:
    """A step's info over these segments (as `LoRABatchInfo.build` makes it from a batch)."""
    table = torch.tensor([(s.slot, s.rank, s.start, s.end) for s in segments], dtype=torch.int64)
    return LoRABatchInfo(order, segments, table, torch.device(DEVICE))


def step_info(gathered: bool, base_rows: int, seed: int) -> tuple[LoRABatchInfo, int]:
    """SEGMENTS over the step's rows, and the step's row count: in place (no order), or a shuffled order
    that leaves `base_rows` rows on the base."""
    segments, start = [], 0
    for slot, rank, rows in SEGMENTS:
        segments.append(Segment(slot, rank, start, start + rows))
        start += rows
    if not gathered:
        return info_of(None, tuple(segments)), start
    total = start + base_rows
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:start]
    return info_of(order.to(DEVICE), tuple(segments)), total


def run_triton(weights: LayerLoRAWeights, out, x, info: LoRABatchInfo) -> torch.Tensor:
    subs = weights.subs
    return triton_lora.add_delta(
        out, x, weights.a, weights.b, info.order, info.device_table,
        tuple(s.out_offset for s in subs), tuple(s.out_size for s in subs), info.max_segment_rows,
    )  # fmt: skip


def compare(weights, info, x, out, atol) -> torch.Tensor:
    """The kernels' result against the reference's, each on its own copy of `out`; the kernels' returned."""
    want = weights.add_delta(out.clone(), x, info)
    got = run_triton(weights, out.clone(), x, info)
    assert got.dtype == out.dtype
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    return got


DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=BF16_UNSUPPORTED),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gathered", [False, True], ids=["in-place", "order"])
@pytest.mark.parametrize("layer", [FUSED, PLAIN], ids=["fused-qkv", "plain"])
def test_equals_the_torch_path(layer, gathered, dtype):
    """Ranks 8 and 16 in one step, segments of 1, 3 and 17 rows; rows no segment holds stay bit-identical."""
    weights = layer_weights(layer, dtype, seed=1)
    info, total = step_info(gathered, base_rows=5, seed=2)
    x, out = inputs(layer, total, dtype, seed=3)
    got = compare(weights, info, x, out, FP32_ATOL if dtype == torch.float32 else REDUCED_ATOL[dtype])
    if gathered:
        untouched = torch.ones(total, dtype=torch.bool, device=DEVICE)
        untouched[info.order] = False
        assert untouched.sum() == 5
        assert torch.equal(got[untouched], out[untouched])


def test_strided_x():
    """x as a slice of a wider activation (row stride larger than its width, a nonzero offset)."""
    weights = layer_weights(FUSED, torch.float32, seed=4)
    info, total = step_info(True, base_rows=3, seed=5)
    wide, out = inputs(Layer(FUSED.subs, FUSED.out_features, FUSED.in_features + 24), total, torch.float32, 6)
    x = wide[:, 7 : 7 + FUSED.in_features]
    assert x.stride(0) > x.shape[1]
    compare(weights, info, x, out, FP32_ATOL)


def test_padding_beyond_each_rank_is_never_read():
    """The pool's rows beyond each adapter's rank (A's beyond nsub x rank, B's beyond rank) and every
    unused slot are NaN: the output has none."""
    weights = layer_weights(FUSED, torch.float32, seed=7, padding=float("nan"))
    assert weights.a.isnan().any() and weights.b.isnan().any()
    info, total = step_info(True, base_rows=4, seed=8)
    x, out = inputs(FUSED, total, torch.float32, seed=9)
    assert not compare(weights, info, x, out, FP32_ATOL).isnan().any()


def test_columns_outside_every_sub_module_are_left_alone():
    """Output columns no sub-module owns keep their bits (a -0.0 stays -0.0, not -0.0 + 0.0), and B's
    columns there (NaN) are never read."""
    weights = layer_weights(GAPPED, torch.float32, seed=10, padding=float("nan"))
    info, total = step_info(True, base_rows=2, seed=11)
    x, out = inputs(GAPPED, total, torch.float32, seed=12)
    owned = torch.zeros(GAPPED.out_features, dtype=torch.bool, device=DEVICE)
    for offset, size in GAPPED.subs:
        owned[offset : offset + size] = True
    out[:, ~owned] = -0.0
    got = compare(weights, info, x, out, FP32_ATOL)
    assert not got.isnan().any() and torch.signbit(got[:, ~owned]).all()


CUDA_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative to the fp64 reference delta's norm


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_realistic_shapes_on_cuda(dtype):
    """SmolLM2-135M's qkv (in 576; q 576, k 192, v 192), four rank-16 adapters over 64 of 80 rows: eagerly,
    and replayed from a CUDA graph after the table and order change (same segment count, none longer)."""
    sizes, in_features, rank, rows, total, longest = (576, 192, 192), 576, 16, 64, 80, 40
    subs = tuple(SubModule(f"s{i}", i, sum(sizes[:i]), n, n) for i, n in enumerate(sizes))
    offsets = tuple(s.out_offset for s in subs)
    pool = LayerLoRAWeights(subs, in_features, sum(sizes), None, 0, 4, rank, dtype, "cuda")
    reference = LayerLoRAWeights(subs, in_features, sum(sizes), None, 0, 4, rank, torch.float64, "cuda")
    gen = torch.Generator().manual_seed(10)
    pool.a.copy_(torch.randn(pool.a.shape, generator=gen) / in_features**0.5)
    pool.b.copy_(torch.randn(pool.b.shape, generator=gen) / rank**0.5)
    reference.a.copy_(pool.a)
    reference.b.copy_(pool.b)
    x = torch.randn(total, in_features, generator=gen).to(dtype).cuda()
    out = torch.randn(total, sum(sizes), generator=gen).to(dtype).cuda()

    def step(lengths: list[int], seed: int) -> LoRABatchInfo:
        bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        segments = tuple(Segment(slot, rank, bounds[slot], bounds[slot + 1]) for slot in range(4))
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:rows]
        return info_of(order.cuda(), segments)

    def check(got: torch.Tensor, info: LoRABatchInfo) -> None:
        want = reference.add_delta(out.double(), x.double(), info)
        assert got.dtype == dtype and torch.isfinite(got).all()
        error = (got.double() - want).norm() / (want - out.double()).norm()
        assert error < CUDA_TOLERANCE[dtype], f"relative error {error:.2e}"

    def run(target: torch.Tensor, table: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return triton_lora.add_delta(target, x, pool.a, pool.b, order, table, offsets, sizes, longest)

    first = step([longest, 1, 7, 16], seed=11)
    table, order = first.table.cuda(), first.order.clone()
    check(run(out.clone(), table, order), first)
    target = out.clone()
    run(target.clone(), table, order)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(target, table, order)
    second = step([3, longest, 20, 1], seed=12)
    table.copy_(second.table)
    order.copy_(second.order)
    graph.replay()
    check(target, second)


def lora_runner(model_dir: str, adapters: dict[str, str], backend: str) -> ModelRunner:
    runner = ModelRunner(
        model_dir,
        max_total_tokens=512,
        max_running_requests=4,
        device=DEVICE,
        quantization="none",
        lora=LoRAConfig(max_loras_per_batch=2, max_lora_rank=16, backend=backend),
    )
    for name, path in adapters.items():
        runner.lora.load(name, path)
    return runner


def test_a_runner_on_the_triton_backend_decodes_what_torch_native_does(tiny_model_dir, tmp_path):
    """--lora-backend triton end to end: a prefill and decode steps of the base and two adapters (ranks 8
    and 16) in one batch, every adapted layer's products by the kernels."""
    adapters = {
        "r8": save_peft_adapter(tiny_model_dir, tmp_path / "r8", rank=8, seed=1),
        "r16": save_peft_adapter(tiny_model_dir, tmp_path / "r16", rank=16, seed=2),
    }
    logits = {}
    for backend in ("torch_native", "triton"):
        runner = lora_runner(tiny_model_dir, adapters, backend)
        driver = PagedDriver.on_empty_pools(runner)
        seqs = [driver.new_seq(name) for name in ("r16", None, "r8")]
        steps = [driver.extend(seqs, [[11, 12, 13, 14], [21, 22], [31, 32, 33]])]
        for _ in range(2):
            steps.append(driver.decode(seqs, steps[-1].argmax(-1).tolist()))
        logits[backend] = torch.stack(steps)
    assert logits["triton"].shape == (3, 3, logits["triton"].shape[-1])
    torch.testing.assert_close(logits["triton"], logits["torch_native"], atol=1e-4, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_triton_backend_without_cuda_or_its_interpreter_is_a_start_up_error(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--lora-backend triton needs a CUDA device"):
        lora_runner(tiny_model_dir, {}, "triton")
