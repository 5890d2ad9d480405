"""W8A8 int8 linear layers for the CPU (`--quantization w8a8_int8`).

Why int8: a decode step streams every weight once, and this CPU's fp32 matmuls are memory-bound at small
batches; int8 weights are a quarter of the bytes, and int8 x int8 -> int32 products run on the CPU's
integer dot-product units (VNNI, AMX where present).

The kernels: for up to 8 tokens (decode), srt's own fused C kernel (`cpu_kernels.py`) does the whole
layer in one call (quantize, integer dot products against the plain int8 weight, rescale, bias): at that
size a layer through PyTorch was a dozen small ops and oneDNN's fixed cost, 4-5x the time of reading the
weight. For more tokens, PyTorch's oneDNN int8 linear on a weight packed once at load
(`onednn::qlinear_prepack`, `onednn::qlinear_pointwise`), with the quantization before it and the
combination after it done by the C kernels too. Both give the same bits, so a token's result does not
depend on its batch. `torch._int_mm` repacks the weight at every call; `scripts/bench_int8_gemm.py` measured
it 1.3x slower than the packed kernel at one sequence and 3-6x slower at 64-512 rows. Where the packed
kernel is missing or disagrees with `_int_mm` on a probe, `_int_mm` is used; where the C kernels cannot be
built, PyTorch ops (`torch_w8a8_linear`).

The numerics: weights are quantized symmetrically per output channel (once, at load: `quantization.py`,
with GPTQ's error-compensating rounding from `gptq.py`), activations per token at every call (scaled by the
row's absmax / 63 and rounded), with no loop over channels or blocks.

Per-token int8 alone leaves every activation with a rounding error of up to absmax/254, and a few outlier
input channels (present in every Llama's hidden states) set that absmax: +1.5-1.8 % perplexity on this model,
which SmoothQuant-style smoothing only brought to +1.5 %. So each activation row is quantized in two levels:
its 7-bit image, then the 7-bit image of what that left (the residual, 63x smaller). Both go through one
kernel call as 2M rows: at decode sizes the call is bound by reading the weight, so the second level is
nearly free, and the activation is then exact to about 1/8,000 of its absmax. What remains is mostly the
weights' rounding (`scripts/eval_quality.py` measures the whole).

Why 7 bits ([-63, 63]) rather than 8 for the activations: the two levels make one 14-bit integer
v = 126 * q1 + q2 (|v| <= 8001), which AVX2 multiplies in one int16 vpmaddwd against the weights widened to
int16, exactly, with int32 sums of up to 2048 products (8001 * 127 * 2048 < 2^31): two multiply
instructions per 32 products where the byte levels took four: 1.2x (one token) to 1.8x (64 and more)
faster on a 2-core AMD EPYC.
VNNI multiplies the byte levels offset by 64: unsigned bytes of at most 127 for vpdpbusd.

The accumulation is exact; the two levels' integer products meet in one integer, 126 * acc1 + acc2, and
the result is dequantized once as (that * s_channel) * (s / 126) (+ bias), in fp32. Every row is quantized
on its own, so a sequence's result does not depend on its batch.
"""

from __future__ import annotations

import functools
import time

import torch

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.layers.int8_math import (
    PACKED_MAX_K,
    Int8Weight,
    int8_products,
    packed_int8_matmul,
    torch_w8a8_linear,
)

# The speed probe's shape (rows, features, outputs) and how much slower than `_int_mm` the packed kernel may
# be there. oneDNN falls back to its reference int8 matmul on some CPUs (seen on a 2-core AMD EPYC with
# AVX-512 but no AMX: `ref_int8`, ~1,000x slower than `_int_mm`, a 5,000-token prefill took minutes), and a
# correctness probe alone cannot tell.
SPEED_PROBE_SHAPE = (64, 512, 512)
PACKED_MAX_SLOWDOWN = 3.0
SPEED_PROBE_RUNS = 2
# The CPU flag without which the probe is not run: on every CPU without AMX measured (Intel Xeon with
# AVX-512 VNNI, AMD EPYC Zen 3 and 4) oneDNN's packed int8 kernel was its reference one (66-12,000x
# `_int_mm`'s time), and finding that out took 1.5-3.5 s of a 2-core machine's start.
PACKED_KERNEL_CPU_FLAG = "amx_int8"


def _best_seconds(fn, runs: int = SPEED_PROBE_RUNS) -> float:
    fn()  # the first call may create the kernel
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def packed_kernel_available() -> bool:
    """Whether oneDNN's packed int8 linear exists in this build, reproduces `_int_mm` exactly (integer
    products below 2^24 with unit scales must come back as the same whole numbers) and is not a slow
    fallback (at most PACKED_MAX_SLOWDOWN times `_int_mm`'s time on a probe): checked once per process, and
    only on a CPU with PACKED_KERNEL_CPU_FLAG (or whose flags cannot be read)."""
    flags = cpu_flags()
    if flags is not None and PACKED_KERNEL_CPU_FLAG not in flags:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randint(-127, 128, (24, 64), dtype=torch.int8, generator=gen)
        probe = Int8Weight(w, torch.rand(24, generator=gen) + 0.5)
        probe.pack_unchecked()
        x = torch.randint(-127, 128, (5, 64), dtype=torch.int8, generator=gen)
        expected = torch._int_mm(x, w.t()).to(torch.float32)  # noqa: SLF001 (PyTorch's exact int8 matmul has no public name)
        if not torch.equal(packed_int8_matmul(x, probe), expected):
            return False
        return packed_kernel_speed_ratio() <= PACKED_MAX_SLOWDOWN
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as Linux lists them, or None where /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def packed_kernel_speed_ratio() -> float:
    """The packed kernel's time over `_int_mm`'s on SPEED_PROBE_SHAPE (best of a few runs each)."""
    rows, k, n = SPEED_PROBE_SHAPE
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    probe = Int8Weight(w, torch.ones(n))
    probe.pack_unchecked(keep_plain=True)
    x = torch.randint(-63, 64, (rows, k), dtype=torch.int8, generator=gen)
    packed = _best_seconds(lambda: packed_int8_matmul(x, probe))
    plain = _best_seconds(lambda: torch._int_mm(x, probe.weight_t))  # noqa: SLF001 (PyTorch's exact int8 matmul has no public name)
    return packed / max(plain, 1e-9)


def w8a8_linear(x: torch.Tensor, qw: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` computed in int8: x [..., K] fp32 -> [..., N] fp32. Through `cpu_kernels`
    when they loaded (one fused call where `takes_linear`; else their quantize and combine around oneDNN's
    int8 matmul), else through PyTorch ops; all give the same bits."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return torch_w8a8_linear(x, qw, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    if qw.weight is not None and kernels.takes_linear(m, k, qw.packed is not None):
        out = kernels.linear(x2, qw.weight, qw.scale, bias)
    else:
        q, s = kernels.quantize_two_level(x2)
        out = kernels.combine_two_level(int8_products(q, qw), s, qw.scale, bias)
    return out.view(*shape[:-1], out.shape[-1])


def pack_weight(qw: Int8Weight) -> bool:
    """Prepare the weight for the fastest kernels here: oneDNN's packed form when that kernel is there
    and exact (False otherwise), and, for the fused linear of `cpu_kernels` where that one is used (a
    few tokens with VNNI; every call where oneDNN is not exact), the plain weight; a
    plain weight no kernel reads is dropped (it would double the weights' memory): save it first. A weight
    already packed stays as it is."""
    if qw.packed is not None:
        return True
    kernels = cpu_kernels.load()
    packed = packed_kernel_available() and qw.weight.shape[1] <= PACKED_MAX_K
    fused = kernels is not None and (kernels.use_small_linear or not packed)
    if not packed:
        return False
    qw.pack_unchecked(keep_plain=fused)
    return True
