"""How fast srt multiplies GGUF block formats (`cpu_gguf_kernels.c`), per ggml type, at 1 and 16 token rows:
the measurement behind the activation choice in `gguf_linear.py` (per-block int8 activations against exact
fp32 ones) and a comparison with what srt ran before GGUF blocks (its int8 W8A8 kernel, and fp32).

Each layer call reads a different copy of the weight, cycling through copies that together exceed the
last-level cache (`--weights-mb`), so the weights come from memory as in a decode step of a real model.
Methods are timed round-robin, one call each per round, so a busy machine slows them alike; the figure is
the best of `--rounds` (on a shared machine the others are preemptions, not the kernel).

    gguf-q8   srt's GGUF kernel: activations quantized per block of 32 (what the `gguf` method runs)
    gguf-f32  the same blocks with exact fp32 activations (block_matmul(exact=True))
    int8      srt's W8A8 kernel on an int8 copy of the weight (--quantization w8a8_int8)
    fp32      F.linear on the dequantized fp32 weight (--quantization none)

Columns: ms per call, token rows per second through this one layer, and weight GB/s (the file's bytes
for GGUF, int8 bytes, fp32 bytes). Run it on a quiet machine: on 2 cores anything else running skews it.

    [OMP_NUM_THREADS=1] .venv/bin/python scripts/bench_gguf_gemm.py [--types Q4_K Q6_K] [--rows 1 16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.layers.gguf_linear import BlockMatrix, block_matmul, dequantize_rows
from srt.model_executor.layers.int8_math import quantize_per_channel

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# (out, in): TinyLlama-1.1B's attention projections and its gate/up (one of the two)
SHAPES = ((2048, 2048), (5632, 2048))
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_matrix(name: str, rows: int, cols: int, seed: int) -> BlockMatrix:
    """Random blocks with small finite fp16 scales: any such bytes are a valid block of these types."""
    qtype = GGMLQuantizationType[name]
    elements, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // elements, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        scale = (rng.standard_normal((rows, cols // elements)) * 0.01).astype(np.float16)
        blocks[..., at : at + 2] = scale.view(np.uint8).reshape(rows, cols // elements, 2)
    return BlockMatrix(int(qtype), rows, cols, torch.from_numpy(blocks.reshape(rows, -1)))


def copies(first, nbytes: int, total_mb: int, make) -> list:
    """Enough weights (`first` and copies made by `make`) to exceed total_mb together."""
    n = max(2, -(-total_mb * 2**20 // nbytes))
    return [first] + [make() for _ in range(n - 1)]


def methods(name: str, rows: int, cols: int, total_mb: int) -> dict[str, tuple[list, int, object]]:
    """method -> (weights to cycle through, bytes of one, call(x, w))"""
    m = random_matrix(name, rows, cols, seed=0)
    dense = dequantize_rows(m, torch.arange(rows))
    q8 = quantize_per_channel(dense)
    kernels = cpu_kernels.load()
    blocks = copies(m, m.data.numel(), total_mb, lambda: BlockMatrix(m.qtype, rows, cols, m.data.clone()))
    table = {
        "gguf-q8": (blocks, m.data.numel(), lambda x, w: block_matmul(x, w)),
        "gguf-f32": (blocks, m.data.numel(), lambda x, w: block_matmul(x, w, exact=True)),
        "fp32": (copies(dense, dense.numel() * 4, total_mb, dense.clone), dense.numel() * 4, F.linear),
    }
    if kernels is not None:
        int8 = copies(q8, q8.weight.numel(), total_mb, lambda: type(q8)(q8.weight.clone(), q8.scale.clone()))
        table["int8"] = (int8, q8.weight.numel(), lambda x, w: kernels.linear(x, w.weight, w.scale, None))
    return table


def bench(
    name: str, rows: int, cols: int, tokens: int, rounds: int, total_mb: int
) -> dict[str, tuple[float, int]]:
    """method -> (best seconds per call, bytes of one weight)"""
    table = methods(name, rows, cols, total_mb)
    x = torch.randn(tokens, cols)
    times: dict[str, list[float]] = {k: [] for k in table}
    position = dict.fromkeys(table, 0)
    for _ in range(rounds + 1):  # the first round warms up
        for k, (weights, _, call) in table.items():
            w = weights[position[k] % len(weights)]
            position[k] += 1
            t0 = time.perf_counter()
            call(x, w)
            times[k].append(time.perf_counter() - t0)
    return {k: (min(v[1:]), table[k][1]) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16], help="token rows per call")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--weights-mb", type=int, default=320, help="weight copies cycled through, in all")
    args = p.parse_args()
    kernels = cpu_kernels.load()
    print(f"threads {torch.get_num_threads()}, kernels {kernels.isa if kernels else 'none (no int8 column)'}")
    print(f"{'type':<6}{'out x in':>12}{'M':>4}  {'method':<9}{'ms':>9}{'tok/s':>10}{'GB/s':>7}")
    for name in args.types:
        for rows, cols in SHAPES:
            for tokens in args.rows:
                result = bench(name, rows, cols, tokens, args.rounds, args.weights_mb)
                for k, (t, nbytes) in result.items():
                    gbs = nbytes / t / 1e9
                    print(
                        f"{name:<6}{rows:>6}x{cols:<5}{tokens:>4}  {k:<9}{t * 1e3:>9.3f}{tokens / t:>10.0f}{gbs:>7.1f}"
                    )


if __name__ == "__main__":
    main()
