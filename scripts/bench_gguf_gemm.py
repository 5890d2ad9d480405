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

    base-q8   `--baseline FILE.c`: gguf-q8 of another version of cpu_gguf_kernels.c (e.g. `git show
              HEAD~1:srt/model_executor/layers/cpu_gguf_kernels.c > /tmp/old.c`), built alone beside this
              one's source built the same way (`new-q8`), the two alternating call by call: an A/B of a change

`--model 7b` takes Llama-2-7B's shapes (4096 x 4096, 11008 x 4096, 4096 x 11008) and adds its fused layers as
one call each, the parts in Q4_K_M's types (qkv: Q4_K, Q4_K, Q6_K; gate_up: Q4_K twice; `--types` does not
apply to them): what a decode step runs per layer.

Columns: ms per call (the best, and the median of `--rounds`), token rows per second through this one layer
and weight GB/s at the best (the file's bytes for GGUF, int8 bytes, fp32 bytes). Run it on a quiet machine:
on 2 cores anything else running skews it.

    [OMP_NUM_THREADS=1] .venv/bin/python scripts/bench_gguf_gemm.py [--types Q4_K Q6_K] [--rows 1 16]
        [--model 7b] [--methods gguf-q8 base-q8] [--baseline /tmp/old.c]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from srt.model_executor.layers import cpu_kernels
from srt.model_executor.layers.c_abi import bind, parse_prototypes
from srt.model_executor.layers.cpu_kernel_build import FLAGS, HEADERS
from srt.model_executor.layers.gguf_linear import (
    BlockMatrix,
    BlockParts,
    block_matmul,
    block_matmul_parts,
    dequantize_rows,
)
from srt.model_executor.layers.gguf_linear import (
    kernels as gguf_kernels,
)
from srt.model_executor.layers.int8_math import quantize_per_channel

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# (out, in): TinyLlama-1.1B's attention projections and its gate/up (one of the two)
SHAPES = ((2048, 2048), (5632, 2048))
# Llama-2-7B's: attention projections, gate/up (one of the two), down
SHAPES_7B = ((4096, 4096), (11008, 4096), (4096, 11008))
# its fused layers as a Q4_K_M file stores them: name -> (parts' (type, rows), cols)
FUSED_7B = {
    "qkv": ((("Q4_K", 4096), ("Q4_K", 4096), ("Q6_K", 4096)), 4096),
    "gate_up": ((("Q4_K", 11008), ("Q4_K", 11008)), 4096),
}
SOURCE = os.path.join(os.path.dirname(cpu_kernels.__file__), "cpu_gguf_kernels.c")
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


class StandaloneLinear:
    """srt_gguf_linear of one version of cpu_gguf_kernels.c, compiled alone (with the kernels' header and flags)
    into a library of its own: two versions side by side in one process."""

    def __init__(self, source: str, workdir: str, tag: str):
        path = os.path.join(workdir, f"gguf-{tag}.so")
        include = os.path.dirname(HEADERS[0])
        subprocess.run(["cc", *FLAGS, "-I", include, source, "-o", path, "-lm"], check=True)
        with open(source) as f:
            protos = parse_prototypes(f.read())
        self._linear = bind(ctypes.CDLL(path), protos["srt_gguf_linear"])
        self._act_row_bytes = bind(ctypes.CDLL(path), protos["srt_gguf_act_row_bytes"])

    def __call__(self, x: torch.Tensor, plan: BlockParts) -> torch.Tensor:
        t = x.shape[0]
        out = torch.empty((t, plan.rows), dtype=torch.float32)
        act = torch.empty((t, self._act_row_bytes(plan.cols)), dtype=torch.uint8)
        rc = self._linear(
            x.data_ptr(), t, plan.cols, x.stride(0), len(plan.parts), plan.desc.data_ptr(),
            act.data_ptr(), out.data_ptr(), plan.rows,
        )  # fmt: skip
        assert rc == 0
        return out


def ab_methods(parts: list[BlockMatrix], total_mb: int, builds: dict) -> dict[str, tuple[list, int, object]]:
    """the block methods (gguf-q8, and base-q8/new-q8 of `builds`) on the fused parts, copies cycled through"""
    nbytes = sum(p.data.numel() for p in parts)

    def copy() -> BlockParts:
        return BlockParts([BlockMatrix(p.qtype, p.rows, p.cols, p.data.clone()) for p in parts])

    # copies of their own for each method: one reading the copy another read just before finds it in cache
    table = {"gguf-q8": (copies(BlockParts(parts), nbytes, total_mb, copy), nbytes, block_matmul_parts)}
    for tag, lib in builds.items():
        table[f"{tag}-q8"] = (copies(copy(), nbytes, total_mb, copy), nbytes, lib)
    return table


def methods(
    name: str, rows: int, cols: int, total_mb: int, wanted: set[str], builds: dict
) -> dict[str, tuple[list, int, object]]:
    """method -> (weights to cycle through, bytes of one, call(x, w)), those `wanted` only"""
    m = random_matrix(name, rows, cols, seed=0)
    if wanted <= {"gguf-q8", "base-q8", "new-q8"}:
        return {k: v for k, v in ab_methods([m], total_mb, builds).items() if k in wanted}
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
    table.update(ab_methods([m], total_mb, builds))
    return {k: v for k, v in table.items() if k in wanted}


def bench(
    table: dict, cols: int, tokens: int, rounds: int, clock=time.perf_counter
) -> dict[str, tuple[float, float, int]]:
    """method -> (best and median seconds per call by `clock`, bytes of one weight)"""
    x = torch.randn(tokens, cols)
    times: dict[str, list[float]] = {k: [] for k in table}
    position = dict.fromkeys(table, 0)
    for _ in range(rounds + 1):  # the first round warms up
        for k, (weights, _, call) in table.items():
            w = weights[position[k] % len(weights)]
            position[k] += 1
            t0 = clock()
            call(x, w)
            times[k].append(clock() - t0)
    return {k: (min(v[1:]), statistics.median(v[1:]), table[k][1]) for k, v in times.items()}


def report(name: str, shape: str, tokens: int, result: dict) -> None:
    for k, (best, median, nbytes) in result.items():
        gbs = nbytes / best / 1e9
        print(
            f"{name:<14}{shape:>12}{tokens:>4}  {k:<9}{best * 1e3:>9.3f}{median * 1e3:>9.3f}"
            f"{tokens / best:>10.0f}{gbs:>7.1f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16], help="token rows per call")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--weights-mb", type=int, default=320, help="weight copies cycled through, in all")
    p.add_argument("--model", choices=("1.1b", "7b"), default="1.1b", help="whose shapes")
    all_methods = ("gguf-q8", "gguf-f32", "int8", "fp32", "base-q8", "new-q8")
    p.add_argument("--methods", nargs="+", choices=all_methods, default=None, help="default: all that apply")
    p.add_argument("--baseline", help="another version of cpu_gguf_kernels.c to compare (base-q8, new-q8)")
    p.add_argument("--candidate", default=SOURCE, help="the version new-q8 runs (default: this checkout's)")
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the process's CPU time, not the wall clock: a figure the other processes of a busy machine "
        "do not stretch (they still share its caches); with several threads run it with "
        "OMP_WAIT_POLICY=passive, so that a thread waiting for the others sleeps instead of counting",
    )
    args = p.parse_args()
    if args.cpu_time and torch.get_num_threads() > 1 and os.environ.get("OMP_WAIT_POLICY") != "passive":
        p.error("--cpu-time with several threads counts their spinning: set OMP_WAIT_POLICY=passive")
    clock = time.process_time if args.cpu_time else time.perf_counter
    kernels = cpu_kernels.load()
    gguf_kernels()  # built before the timing
    print(f"threads {torch.get_num_threads()}, kernels {kernels.isa if kernels else 'none (no int8 column)'}")
    with tempfile.TemporaryDirectory() as workdir:
        builds = {}
        if args.baseline:
            builds = {
                "base": StandaloneLinear(args.baseline, workdir, "base"),
                "new": StandaloneLinear(args.candidate, workdir, "new"),
            }
        wanted = set(args.methods or [m for m in all_methods if m not in ("base-q8", "new-q8") or builds])
        print(
            f"{'type':<14}{'out x in':>12}{'M':>4}  {'method':<9}{'best ms':>9}{'med ms':>9}{'tok/s':>10}{'GB/s':>7}"
        )
        shapes = SHAPES_7B if args.model == "7b" else SHAPES
        for name in args.types:
            for rows, cols in shapes:
                for tokens in args.rows:
                    table = methods(name, rows, cols, args.weights_mb, wanted, builds)
                    report(name, f"{rows}x{cols}", tokens, bench(table, cols, tokens, args.rounds, clock))
        if args.model == "7b":
            for layer, (spec, cols) in FUSED_7B.items():
                parts = [random_matrix(t, rows, cols, seed=i) for i, (t, rows) in enumerate(spec)]
                table = ab_methods(parts, args.weights_mb, builds)
                table = {k: v for k, v in table.items() if k in wanted}
                rows = sum(r for _, r in spec)
                for tokens in args.rows:
                    report(layer, f"{rows}x{cols}", tokens, bench(table, cols, tokens, args.rounds, clock))


if __name__ == "__main__":
    main()
