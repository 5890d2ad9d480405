"""Per-step overhead of a decode step outside the model: sampling with penalties on, and the KV free list.

    .venv/bin/python scripts/bench_decode_overhead.py [--batch 64] [--context 8192] [--steps 20]

Sampling: a batch of `--batch` requests with `--context`-token prompts and frequency, presence and repetition
penalties, sampled for `--steps` steps over a SmolLM2-sized vocabulary, each step appending one token per
request (the scheduler's steady decode batch). KV free list: a pool of batch x context slots, every step
freeing one finished request's worth of slots and allocating one slot per request.

Also runs against an older implementation (penalties rebuilt every step, a free list grown by concatenation)
when pointed at such a checkout (PYTHONPATH=<old tree>): it detects which sampler API it finds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from srt.mem_cache.memory_pool import TokenToKVPoolAllocator
from srt.sampling.sampler import Sampler
from srt.sampling.sampling_params import SamplingParams

VOCAB = 49152  # SmolLM2's vocabulary
SEED = 0


class Row:
    def __init__(self, prompt: list[int], params: SamplingParams):
        self.sampling_params = params
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []
        self.generator = None
        self.penalty_row = None


def make_sampling_step(sampler: Sampler, rows: list[Row]):
    """A function running one sampling step of the steady batch, whatever sampler API this tree has."""
    try:
        from srt.sampling.sampling_batch import SamplingBatch
    except ImportError:  # an older tree: parameters passed (and penalties rebuilt) every step
        params = [r.sampling_params for r in rows]
        return lambda logits: sampler.sample(
            logits,
            params,
            [r.origin_input_ids for r in rows],
            [r.output_ids for r in rows],
            [None] * len(rows),
        )
    batch = SamplingBatch.build(rows, VOCAB, sampler.eos_token_ids, sampler.penalty_pool)
    return lambda logits: sampler.sample(logits, batch)


def bench_sampling(batch: int, context: int, steps: int) -> list[float]:
    rng = random.Random(SEED)
    params = SamplingParams(
        temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1
    )
    rows = [Row([rng.randrange(VOCAB) for _ in range(context)], params) for _ in range(batch)]
    sampler = Sampler(VOCAB, eos_token_ids=[2])
    step = make_sampling_step(sampler, rows)
    gen = torch.Generator().manual_seed(SEED)
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, VOCAB, generator=gen)
        t0 = time.perf_counter()
        out = step(logits)
        times.append(time.perf_counter() - t0)
        for row, token in zip(rows, out.next_token_ids, strict=True):
            row.output_ids.append(token)
    return times


def bench_free_list(batch: int, context: int, steps: int) -> list[float]:
    allocator = TokenToKVPoolAllocator(batch * context)
    held = [allocator.alloc(context // 2) for _ in range(batch)]  # half the pool in use
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        allocator.free(held[i % batch])  # a request finishes
        held[i % batch] = allocator.alloc(context // 2)  # another takes its place
        allocator.alloc(batch)  # the decode step's slots
        times.append(time.perf_counter() - t0)
    return times


def summary(name: str, times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times[1:])  # the first step pays one-off costs (pool rows, page faults)
    return (
        f"{name}: median {statistics.median(ms):.2f} ms, max {ms[-1]:.2f} ms, first {times[0] * 1e3:.2f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    print(f"batch {args.batch}, prompts of {args.context} tokens, vocabulary {VOCAB}, {args.steps} steps")
    print(summary("sampling step, 3 penalties", bench_sampling(args.batch, args.context, args.steps)))
    print(summary("KV free + alloc per step", bench_free_list(args.batch, args.context, args.steps)))


if __name__ == "__main__":
    main()
