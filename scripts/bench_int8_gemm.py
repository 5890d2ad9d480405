"""Which int8 GEMM is fastest here, for the embedded model's linear shapes (issue 9's measurement script).

For each (N, K) weight shape and each number of rows M it times, best of `--repeat` after a warm-up:
  fp32        F.linear(x, w)                                   (the baseline)
  int_mm      per-token absmax quantization of x + torch._int_mm + dequantization (all inside the timing):
              what srt's `--quantization w8a8_int8` runs
  int8pack    torch._weight_int8pack_mm (weight-only int8, fp32 activations)
and prints milliseconds and the speed-up over fp32. Run it on a quiet machine: on 2 cores anything else
running makes every figure worthless.

    .venv/bin/python scripts/bench_int8_gemm.py [--rows 1 8 32 128 512] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from srt.model_executor.layers.int8_linear import quantize_per_channel, w8a8_linear

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 kv heads of 64, vocabulary 49152.
SHAPES = {
    "qkv_proj": (960, 576),
    "o_proj": (576, 576),
    "gate_up_proj": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-int8pack", action="store_true", help="weight-only int8 is slow; skip it")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
    )
    print(f"{'layer':<13}{'M':>5}{'fp32 ms':>10}{'int_mm ms':>11}{'x':>6}{'int8pack ms':>13}{'x':>6}")
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        qw = quantize_per_channel(w)
        w_pack = qw.weight_t.t().contiguous()  # [N, K] int8 for _weight_int8pack_mm
        for m in args.rows:
            x = torch.randn(m, k)
            fp32 = best_ms(lambda x=x, w=w: F.linear(x, w), args.repeat)
            int8 = best_ms(lambda x=x, qw=qw: w8a8_linear(x, qw, None), args.repeat)
            line = f"{name:<13}{m:>5}{fp32:>10.3f}{int8:>11.3f}{fp32 / int8:>6.2f}"
            if not args.skip_int8pack:
                pack = best_ms(
                    lambda x=x, w=w_pack, s=qw.scale: torch._weight_int8pack_mm(x, w, s), args.repeat
                )
                line += f"{pack:>13.3f}{fp32 / pack:>6.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
