"""Which int8 GEMM is fastest here, for the embedded model's linear shapes (the measurement behind the kernel
choice described in docs/cpu_execution.md).

Two tables, each the best of `--repeat` after a warm-up, all inside the timing: the activation's two-level
per-token quantization, the int8 product and the dequantization (what `--quantization w8a8_int8` runs).

1. One layer, its weight hot in cache, per (N, K) shape and number of rows M:
     fp32      F.linear(x, w)                      (the baseline)
     int_mm    torch._int_mm on the plain int8 weight (repacked by oneDNN at every call), PyTorch ops around
     packed    oneDNN's int8 linear on a weight packed once (onednn::qlinear_prepack), PyTorch ops around
     srt       what srt runs: its fused C kernel (cpu_kernels.py) up to 8 rows with VNNI, and at every size
               where oneDNN's kernel is not exact (AVX2 without VNNI; `packed` is then nan); else the packed
               kernel with the C kernels' quantization and combination around it
     fused     srt's fused C kernel at every size (what `srt` takes up to `CpuKernels.max_fused_tokens`;
               the column the threshold is chosen from)
     int8pack  torch._weight_int8pack_mm (weight-only int8, fp32 activations; --int8pack)
2. A whole decode step's linear layers: 30 layers x (qkv, o, gate_up, down), each with its own weight, so
   the weights come from memory as in the model (the head is in table 1).

Run it on a quiet machine: on 2 cores anything else running makes every figure worthless.

    .venv/bin/python scripts/bench_int8_gemm.py [--rows 1 8 32 128 512] [--threads N] [--int8pack]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.layers.int8_linear import pack_weight, packed_kernel_available, w8a8_linear
from srt.model_executor.layers.int8_math import quantize_per_channel, torch_w8a8_linear

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 kv heads of 64, vocabulary 49152.
SHAPES = {
    "qkv_proj": (960, 576),
    "o_proj": (576, 576),
    "gate_up_proj": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}
LAYERS = 30


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def quantized(w: torch.Tensor, packed: bool):
    """The plain int8 weight (packed=False: what `_int_mm` reads), or the weight prepared as srt prepares it
    (`Int8Weight.pack`: oneDNN's packed form where that kernel is exact, the plain one with row sums for
    srt's fused kernel where that one reads it)."""
    qw = quantize_per_channel(w)
    if packed:
        pack_weight(qw)
    return qw


def fused_linear(x: torch.Tensor, qw) -> torch.Tensor:
    """srt's fused C kernel whatever the size (`fused`)."""
    return cpu_kernels.load().linear(x, qw.weight, qw.scale, None)


def packed_ms(fn, qw, repeat: int) -> float:
    """The `packed` column: NaN where oneDNN's int8 linear is missing or inexact (AVX2 without VNNI)."""
    return best_ms(fn, repeat) if qw.packed is not None else float("nan")


def one_layer_table(args) -> None:
    print("\none layer, weight hot in cache (ms; x = speed-up over fp32)")
    head = f"{'layer':<13}{'M':>5}{'fp32':>9}{'int_mm':>9}{'x':>6}{'packed':>9}{'x':>6}{'srt':>9}{'x':>6}"
    head += f"{'fused':>9}{'x':>6}"
    print(head + (f"{'int8pack':>10}{'x':>6}" if args.int8pack else ""))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        plain, packed = quantized(w, False), quantized(w, True)
        for m in args.rows:
            x = torch.randn(m, k)
            fp32 = best_ms(lambda x=x, w=w: F.linear(x, w), args.repeat)
            a = best_ms(lambda x=x, qw=plain: torch_w8a8_linear(x, qw, None), args.repeat)
            b = packed_ms(lambda x=x, qw=packed: torch_w8a8_linear(x, qw, None), packed, args.repeat)
            c = best_ms(lambda x=x, qw=packed: w8a8_linear(x, qw, None), args.repeat)
            line = f"{name:<13}{m:>5}{fp32:>9.3f}{a:>9.3f}{fp32 / a:>6.2f}{b:>9.3f}{fp32 / b:>6.2f}"
            line += f"{c:>9.3f}{fp32 / c:>6.2f}"
            d = best_ms(lambda x=x, qw=plain: fused_linear(x, qw), args.repeat)
            line += f"{d:>9.3f}{fp32 / d:>6.2f}"
            if args.int8pack:
                pack = best_ms(
                    lambda x=x, w=plain.weight, s=plain.scale: torch._weight_int8pack_mm(x, w, s), args.repeat
                )
                line += f"{pack:>10.3f}{fp32 / pack:>6.2f}"
            print(line, flush=True)


def decode_step_table(args) -> None:
    print(f"\n{LAYERS} layers x (qkv, o, gate_up, down), distinct weights (ms for all of them)")
    print(
        f"{'M':>5}{'fp32':>9}{'int_mm':>9}{'x':>6}{'packed':>9}{'x':>6}{'srt':>9}{'x':>6}{'fused':>9}{'x':>6}"
    )
    layer_shapes = [s for name, s in SHAPES.items() if name != "lm_head"]
    weights = [[torch.randn(n, k) * 0.05 for n, k in layer_shapes] for _ in range(LAYERS)]
    plain = [[quantized(w, False) for w in ws] for ws in weights]
    packed = [[quantized(w, True) for w in ws] for ws in weights]
    for m in args.rows:
        xs = {k: torch.randn(m, k) for _, k in layer_shapes}

        def step(layers, fn, xs=xs):
            def run() -> None:  # results are dropped at once, as a forward pass drops them
                for ws in layers:
                    for w, (_, k) in zip(ws, layer_shapes, strict=True):
                        fn(xs[k], w)

            return run

        fp32 = best_ms(step(weights, lambda x, w: F.linear(x, w)), args.repeat)
        a = best_ms(step(plain, lambda x, qw: torch_w8a8_linear(x, qw, None)), args.repeat)
        b = packed_ms(step(packed, lambda x, qw: torch_w8a8_linear(x, qw, None)), packed[0][0], args.repeat)
        c = best_ms(step(packed, lambda x, qw: w8a8_linear(x, qw, None)), args.repeat)
        d = best_ms(step(plain, fused_linear), args.repeat)
        line = (
            f"{m:>5}{fp32:>9.2f}{a:>9.2f}{fp32 / a:>6.2f}{b:>9.2f}{fp32 / b:>6.2f}{c:>9.2f}{fp32 / c:>6.2f}"
            f"{d:>9.2f}{fp32 / d:>6.2f}"
        )
        print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--int8pack", action="store_true", help="also time weight-only int8 (slow here)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}, packed kernel exact: {packed_kernel_available()}, "
        f"srt's C kernels: {kernels.isa if (kernels := cpu_kernels.load()) else 'unavailable'}"
    )
    one_layer_table(args)
    decode_step_table(args)


if __name__ == "__main__":
    main()
