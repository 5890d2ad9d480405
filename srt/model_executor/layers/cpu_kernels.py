"""Loads srt's fused int8 kernels for the CPU (`cpu_*_kernels.c`, one library built by
`cpu_kernel_build.py`), and calls them.

The C ABI is declared once, by the sources: each exported `srt_*` function's ctypes signature is read from
its prototype at load (`prototypes`, `bind`), so an argument added on one side only is a TypeError at the
call, never a misread register. `CpuKernels`' methods check their tensors; `CpuKernels.function` hands the
typed C function to a caller that checked its operands once (`cpu_decode.py`).

Nothing depends on it: without a compiler, on a CPU without AVX2, or if the built library ever disagrees
with the PyTorch path on the probe, `load()` returns None and `int8_linear.py` keeps its PyTorch ops
(`int8_math.py`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import subprocess
import time

import torch

from srt.model_executor.attention.window_cap import window_and_cap_args
from srt.model_executor.layers import int8_math as ref
from srt.model_executor.layers.c_abi import Prototype, bind
from srt.model_executor.layers.cpu_kernel_build import build, prototypes

logger = logging.getLogger(__name__)

ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512-vnni"}
# With VNNI a library kernel is exact too, and the fused linear takes only the token counts where it measured
# faster (scripts/bench_int8_gemm.py, a decode step's 120 distinct weights streamed from memory; 2-core AMD
# EPYC Zen 4, docs/benchmarks): against `_int_mm` 75 ms against 81 at 128 tokens, 154 against 147 at 256.
FUSED_TOKENS_BESIDE_INT_MM = 128
# ... and beside oneDNN's packed kernel (where it is exact: measured on an Intel Xeon with AMX, a few tokens
# only, before the 4 x 4 tiles; not measured since).
FUSED_TOKENS_BESIDE_PACKED = 8
# the probe's largest call spans three of the linear kernel's token blocks
# (TOKEN_BLOCK in cpu_int8_linear_kernels.c)
TOKEN_BLOCK_PROBE = 32
# a load that took this long compiled, or waited for another process's compile: the start-up log says so
BUILD_WAIT_LOGGED_S = 0.5


class _Functions:
    """The library's exported kernels as attributes, each bound by its C prototype (`bind`); only those
    (a name the sources do not export is an AttributeError, not an unchecked call)."""

    def __init__(self, lib: ctypes.CDLL, protos: dict[str, Prototype]):
        for name, proto in protos.items():
            setattr(self, name, bind(lib, proto))


class CpuKernels:
    """The loaded library, with its limits read from it (they live in one place: the C sources)."""

    def __init__(self, path: str):
        self.path = path
        self._c = lib = _Functions(ctypes.CDLL(path), prototypes())
        self.isa = ISA_NAMES.get(lib.srt_isa(), "unknown")
        self.k_multiple = lib.srt_k_multiple()
        self.max_small_rows = lib.srt_max_rows() // 2  # tokens: two activation rows each
        self.max_k = lib.srt_max_k()
        # The fused linear replaces an exact library int8 kernel only where it measured faster (see
        # max_fused_tokens): with VNNI. An AVX2 build on a VNNI machine once ran a batch-1 decode step in
        # 20-25 ms against 15 ms through oneDNN. Where no library kernel is exact (AVX2 without VNNI: oneDNN's
        # int8 saturates), it takes every call.
        self.use_small_linear = self.isa == "avx512-vnni"

    def function(self, name: str):
        """The raw C function `name`, typed by its prototype in the sources (`bind`), for a caller that binds
        it once and calls it in a hot loop on operands it has checked itself (`cpu_decode.py`): it takes
        addresses, and ctypes checks the number and types of its arguments, not the tensors behind them (the
        methods below are the checked way in). KeyError for a name the sources do not export."""
        if name not in prototypes():
            raise KeyError(f"the CPU kernels export no function {name!r}")
        return getattr(self._c, name)

    def max_fused_tokens(self, has_packed: bool) -> int | None:
        """The most tokens a layer call may have for the fused kernel to take it (None: any). With VNNI there
        always is an exact library kernel, oneDNN's packed one or, where that one is missing or a slow
        fallback, `_int_mm` (VNNI accumulates without saturating): the fused kernel takes the token counts
        where it measured faster. Without VNNI, oneDNN's int8 saturates: the fused kernel takes every call."""
        if not self.use_small_linear:
            return 0 if has_packed else None
        return FUSED_TOKENS_BESIDE_PACKED if has_packed else FUSED_TOKENS_BESIDE_INT_MM

    def takes_linear(self, m: int, k: int, has_packed: bool) -> bool:
        """Whether `linear` takes this layer call (m tokens of k features): see `max_fused_tokens`."""
        if k % self.k_multiple:
            return False
        limit = self.max_fused_tokens(has_packed)
        if limit is None:
            return True
        return m <= limit and k <= self.max_k

    def quantize_two_level(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As `int8_math.quantize_two_level` (x: fp32 [M, K] with unit column stride)."""
        m, k = x.shape
        q = torch.empty((2 * m, k), dtype=torch.int8)
        scale = torch.empty((2 * m, 1), dtype=torch.float32)
        self._c.srt_quantize_two_level(x.data_ptr(), m, k, x.stride(0), q.data_ptr(), scale.data_ptr())
        return q, scale

    def combine_two_level(
        self, acc: torch.Tensor, scale: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """As `int8_math.dequantize`: fp32 [M, N] from the int32 products acc [2M, N] of the two levels."""
        rows, n = acc.shape
        m = rows // 2
        out = torch.empty((m, n), dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        self._c.srt_combine_two_level(
            acc.data_ptr(), scale.data_ptr(), wscale.data_ptr(), m, n, b, out.data_ptr()
        )
        return out

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """The whole W8A8 linear layer in one call: x fp32 [M, K] (K a multiple of `k_multiple`) -> [M, N]."""
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty((m, n), dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        q = qscale = None  # a few tokens' quantized rows live on the kernel's stack
        if m > self.max_small_rows or k > self.max_k:  # two byte levels a token (one int16 with AVX2)
            q = torch.empty((2 * m, k), dtype=torch.int8)
            qscale = torch.empty(2 * m, dtype=torch.float32)
        self._c.srt_w8a8_linear(
            x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), scale.data_ptr(), b, n,
            out.data_ptr(), None if q is None else q.data_ptr(), None if qscale is None else qscale.data_ptr(),
        )  # fmt: skip
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximal index over the last dimension of fp32 `logits` (a NaN wins, the first
        one), as `logits.max(dim=-1).indices`: int64 of the leading shape."""
        x2 = _rows(logits)
        rows, n = x2.shape
        if n == 0:
            raise ValueError("argmax of an empty row")
        out = torch.empty(rows, dtype=torch.int64)
        self._c.srt_argmax_rows(x2.data_ptr(), rows, n, x2.stride(0), out.data_ptr())
        return out.view(logits.shape[:-1])

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of fp32 x (any leading shape): a new contiguous tensor."""
        x2 = _rows(x)
        m, k = x2.shape
        out = torch.empty((m, k), dtype=torch.float32)
        self._c.srt_rmsnorm(x2.data_ptr(), m, k, x2.stride(0), weight.data_ptr(), eps, out.data_ptr())
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """silu(gate) * up for gate_up [..., 2 * inter] (gate first, as the fused projection lays it out)."""
        x2 = _rows(gate_up)
        m = x2.shape[0]
        out = torch.empty((m, inter), dtype=torch.float32)
        self._c.srt_silu_mul(x2.data_ptr(), m, inter, x2.stride(0), out.data_ptr())
        return out.view(*gate_up.shape[:-1], inter)

    def lora_add_segments(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        rows: torch.Tensor | None,
        table: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        out_offsets: torch.Tensor,
        out_sizes: torch.Tensor,
    ) -> None:
        """out [m, n] += the LoRA adapters' products of x [m, k], in place (srt_lora_add_segments). Segment s,
        table[s] = (slot, rank, start, end), multiplies the rows rows[start:end] (rows None: the rows
        start..end themselves, every row adapted and grouped) by pool slot `slot`: a [slots, sub-modules x
        max rank, k] (an adapter of rank r keeps sub-module i's A at rows i*r..), b = B^T [slots, max rank, n]
        (scaled); sub-module i owns out's columns out_offsets[i].. of out_sizes[i]. fp32 rows with unit column
        stride; the pool in fp32 or fp16 (widened as read, fp32 products)."""
        if any(t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1 for t in (out, x)):
            raise TypeError("lora_add_segments takes 2-D fp32 rows with unit column stride")
        if (
            a.dtype not in (torch.float32, torch.float16)
            or b.dtype != a.dtype
            or not (a.is_contiguous() and b.is_contiguous())
        ):
            raise TypeError("lora_add_segments takes a contiguous fp32 or fp16 pool")
        index = (table, out_offsets, out_sizes) + (() if rows is None else (rows,))
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in index):
            raise TypeError("lora_add_segments takes contiguous int64 rows, segments, offsets and sizes")
        nsub, (m, k) = out_offsets.numel(), x.shape
        if out.shape[0] != m or a.dim() != 3 or b.dim() != 3 or a.shape[2] != k or table.shape[1:] != (4,):
            raise ValueError("lora_add_segments: the operands' shapes do not agree")
        if table.numel():
            slot, rank, start, end = table.T
            extent = rows.numel() if rows is not None else m
            if (
                bool((slot < 0).any() or (slot >= a.shape[0]).any() or (rank < 0).any())
                or bool((rank * nsub > a.shape[1]).any() or (rank > b.shape[1]).any())
                or bool((start < 0).any() or (end < start).any() or (end > extent).any())
                or (rows is not None and rows.numel() and bool((rows < 0).any() or (rows >= m).any()))
                or bool(((out_offsets + out_sizes) > min(out.shape[1], b.shape[2])).any())
            ):
                raise ValueError("lora_add_segments: a slot, rank, row or column outside its operand")
        self._c.srt_lora_add_segments(
            x.data_ptr(), k, x.stride(0), None if rows is None else rows.data_ptr(), table.shape[0],
            table.data_ptr(), a.data_ptr(), a.stride(0), nsub, b.data_ptr(), b.stride(0), b.stride(1),
            out_offsets.data_ptr(), out_sizes.data_ptr(), int(a.dtype == torch.float16), out.data_ptr(),
            out.stride(0),
        )  # fmt: skip

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate, in place, the first `heads` heads of each row of x [n, >= heads * head_dim] (unit column
        stride) by cos and sin tables of n rows of head_dim / 2 (any shape with those rows)."""
        n = x.shape[0]
        if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < heads * head_dim or x.dtype != torch.float32:
            raise TypeError("rope_ takes 2-D fp32 rows with unit column stride, wide enough for the heads")
        cos2, sin2 = cos.reshape(n, head_dim // 2), sin.reshape(n, head_dim // 2)
        if cos2.stride(1) != 1 or sin2.stride(0) != cos2.stride(0) or sin2.stride(1) != 1:
            raise TypeError("rope_ takes cos and sin tables with unit column stride and equal row strides")
        self._c.srt_rope(
            x.data_ptr(), n, x.stride(0), heads, head_dim, cos2.data_ptr(), sin2.data_ptr(), cos2.stride(0)
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
    ) -> torch.Tensor:
        """One query token per sequence against its cached K/V, read from the pool in place.
        q [bs, heads, head_dim]; k_pool, v_pool [pool slots, kv_heads, head_dim] (fp32 or fp16); slots
        int64 [bs, max_len] (row b's first seq_lens[b] entries are its tokens' slots). With `sliding_window`
        W, a sequence attends over (and the kernel reads) only its last W tokens; with `logit_cap` c, scaled
        scores become c * tanh(score / c). Returns [bs, heads * head_dim]."""
        bs, heads, head_dim = q.shape
        q = _heads_rows(q)
        _check_attention_operands(q, k_pool, v_pool, slots, seq_lens)
        window, cap = window_and_cap_args(sliding_window, logit_cap, "the CPU attention kernels")
        out = torch.empty((bs, heads * head_dim), dtype=torch.float32)
        if self._c.srt_decode_attention_windowed(
            q.data_ptr(), bs, q.stride(0), heads, k_pool.shape[1], head_dim, k_pool.data_ptr(), v_pool.data_ptr(),
            _is_half(k_pool), slots.data_ptr(), slots.shape[1], seq_lens.data_ptr(), scale, window, cap,
            out.data_ptr(),
        ):  # fmt: skip
            raise MemoryError("decode_attention: no memory for the scores scratch")
        return out

    def extend_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        prefix_len: int,
        scale: float,
        out: torch.Tensor,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
    ) -> None:
        """Causal attention of one sequence's n new tokens, written into out [n, heads, head_dim] (contiguous).
        q [n, heads, head_dim]; slots int64 [prefix_len + n]: the sequence's slots, this step's K/V already
        in the pool. `sliding_window` and `logit_cap` as in `decode_attention` (token i is at position
        prefix_len + i). Token i gets to the bit what `decode_attention` would give it at its position."""
        n, heads, head_dim = q.shape
        q = _heads_rows(q)
        _check_attention_operands(q, k_pool, v_pool, slots)
        if slots.shape[0] != prefix_len + n or out.shape != (n, heads, head_dim) or not out.is_contiguous():
            raise ValueError(
                "extend_attention: slots must cover prefix and new tokens; out [n, heads, head_dim]"
            )
        window, cap = window_and_cap_args(sliding_window, logit_cap, "the CPU attention kernels")
        if self._c.srt_extend_attention(
            q.data_ptr(), n, q.stride(0), heads, k_pool.shape[1], head_dim, k_pool.data_ptr(), v_pool.data_ptr(),
            _is_half(k_pool), slots.data_ptr(), prefix_len, scale, window, cap, out.data_ptr(),
        ):  # fmt: skip
            raise MemoryError("extend_attention: no memory for the scores scratch")


def _heads_rows(q: torch.Tensor) -> torch.Tensor:
    """q [tokens, heads, head_dim] with each token's heads packed (any row stride): what the kernels read."""
    return q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


KV_POOL_DTYPES = (torch.float32, torch.float16)  # what the attention kernels read (fp16 converted exactly)


def _is_half(pool: torch.Tensor) -> int:
    return int(pool.dtype == torch.float16)


def _check_attention_operands(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *index) -> None:
    if q.dtype != torch.float32:
        raise TypeError("attention kernels take fp32 queries")
    if k_pool.dtype not in KV_POOL_DTYPES or v_pool.dtype != k_pool.dtype:
        raise TypeError("attention kernels take fp32 or fp16 pools, both of one dtype")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise TypeError("attention kernels take contiguous pools")
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in index):
        raise TypeError("attention kernels take contiguous int64 slots and lengths")
    if k_pool.shape != v_pool.shape or q.shape[1] % k_pool.shape[1] or q.shape[2] != k_pool.shape[2]:
        raise ValueError(
            "attention kernels: pools differ, heads not a multiple of KV heads, or head sizes differ"
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D rows of its last dimension with unit column stride (a view when it can be one): the
    layout every kernel reads. Refuses what the kernels cannot read rather than reading it wrong."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"CPU kernels take fp32 CPU tensors, not {x.dtype} on {x.device}")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def agrees_with_torch(kernels: CpuKernels) -> bool:
    """The probe: every kernel reproduces the PyTorch path of `int8_math.py` to the bit on random data
    with an outlier channel, a bias, and rows of several sizes."""
    gen = torch.Generator().manual_seed(0)
    k, n = 2 * kernels.k_multiple * 3, 40
    w = torch.randn(n, k, generator=gen)
    qw = ref.quantize_per_channel(w)
    bias = torch.randn(n, generator=gen)
    for m in (1, kernels.max_small_rows, 2 * TOKEN_BLOCK_PROBE + 3):
        x = torch.randn(m, k, generator=gen)
        x[:, 1] *= 40.0
        q, s = ref.quantize_two_level(x)
        q2, s2 = kernels.quantize_two_level(x)
        if not (torch.equal(q, q2) and torch.equal(s, s2)):
            return False
        expected = ref.torch_w8a8_linear(x, qw, bias)
        if not torch.equal(kernels.combine_two_level(ref.int8_products(q, qw), s, qw.scale, bias), expected):
            return False
        if not torch.equal(kernels.linear(x, qw.weight, qw.scale, bias), expected):
            return False
    # the elementwise kernels round differently from PyTorch: they must agree to float precision
    x = torch.randn(7, 2 * k, generator=gen) * 4.0
    rms = bias[:1] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    silu = torch.nn.functional.silu(x[:, :k]) * x[:, k:]
    return torch.allclose(
        kernels.rmsnorm(x, bias[:1].expand(2 * k).contiguous(), 1e-5), rms, rtol=1e-5, atol=1e-6
    ) and (torch.allclose(kernels.silu_mul(x, k), silu, rtol=1e-5, atol=1e-6))


def load(block_products: bool = False) -> CpuKernels | None:
    """The kernels for this process, or None where they cannot be built or are not exact (logged once). With
    `block_products`, the library whose GGUF source is built for the `gguf` method's block products (its
    fused decode step calls them from C); every other caller takes the one every path loads
    (`cpu_kernel_build`'s docstring). One object per library, however it is asked for (`load()` and
    `load(block_products=False)` are the same call)."""
    return _load(bool(block_products))


@functools.cache
def _load(block_products: bool) -> CpuKernels | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    start = time.monotonic()
    try:
        kernels = CpuKernels(build(block_products=block_products))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("CPU int8 kernels unavailable, using PyTorch ops instead: %s", str(detail)[-500:])
        return None
    if kernels.isa == "portable" or not agrees_with_torch(kernels):
        logger.warning("CPU int8 kernels (%s) not used: no AVX2, or they disagree with PyTorch", kernels.isa)
        return None
    waited = time.monotonic() - start
    if waited >= BUILD_WAIT_LOGGED_S:  # a cold start's compile, this process's or the launcher's
        logger.info("CPU kernels %s ready after %.1f s of build", os.path.basename(kernels.path), waited)
    return kernels


load.cache_clear = _load.cache_clear  # the tests' way to build (or find) the library again
