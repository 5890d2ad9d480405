"""What adapters cost a decode step of the int8 model, without the server: ModelRunner steps alone.

    .venv/bin/python scripts/bench_lora_step.py [--rank 16] [--steps 200] [--rounds 3]

Loads `--adapters` random adapters of `--rank` on every module (PEFT's format, made in a temporary
directory) into the runner of the embedded SmolLM2 (int8), then per round:
- batch 1: a base sequence and an adapter sequence of 200 cached tokens decode in turn, step after step
  (paired: the machine's drift reaches both alike); median step times and adapter ÷ base;
- batch 16: sixteen base sequences, and sixteen where four in five run one of the adapters (the rest the
  base), decode in turn; median step times and mixed ÷ base.
The issue's targets are server figures (scripts/bench_lora.py); this isolates the model's share of them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from srt.lora.manager import LoRAConfig
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner
from srt.model_source import resolve_model_dir
from srt_bench.lora_adapters import random_peft_adapter

CACHED = 200  # tokens each sequence holds before the timed steps
MIXED_BATCH = 16
WARMUP_STEPS = 5


TOKEN_ID = 1000  # any ordinary token: the content does not change the cost


class Group:
    """Sequences that decode together, each on its adapter (None: the base), `CACHED` tokens already held
    (their K/V contents do not matter for timing)."""

    def __init__(self, runner: ModelRunner, adapters: list[str | None]):
        self.runner, self.adapters = runner, adapters
        self.rows = torch.tensor(runner.req_to_token_pool.alloc(len(adapters)), dtype=torch.int64)
        for row in self.rows.tolist():
            runner.req_to_token_pool.req_to_token[row, :CACHED] = runner.token_to_kv_pool_allocator.alloc(
                CACHED
            )
        self.length = CACHED

    def step(self) -> float:
        """One decode step of the group: seconds, the forward and its argmax."""
        runner, bs = self.runner, len(self.adapters)
        slots = runner.token_to_kv_pool_allocator.alloc(bs)
        runner.req_to_token_pool.req_to_token[self.rows, self.length] = slots
        self.length += 1
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=torch.full((bs,), TOKEN_ID, dtype=torch.int64),
            positions=torch.full((bs,), self.length - 1, dtype=torch.int64),
            out_cache_loc=slots,
            req_pool_indices=self.rows,
            seq_lens=torch.full((bs,), self.length, dtype=torch.int64),
            seq_lens_cpu=[self.length] * bs,
            lora_slots=runner.lora.prepare_step(self.adapters),
        )
        start = time.perf_counter()
        runner.forward(batch).argmax(-1)
        return time.perf_counter() - start


def paired_steps(groups: list[Group], steps: int) -> list[float]:
    """Each group decodes one token in turn, `steps` times: each group's median step (s)."""
    times: list[list[float]] = [[] for _ in groups]
    for _ in range(steps):
        for group, mine in zip(groups, times, strict=True):
            mine.append(group.step())
    return [statistics.median(mine[WARMUP_STEPS:]) for mine in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model_dir = resolve_model_dir(None)
    runner = ModelRunner(
        model_dir,
        max_total_tokens=16384,
        max_running_requests=2 * MIXED_BATCH + 2,
        quantization="w8a8_int8",
        lora=LoRAConfig(max_loras_per_batch=a.adapters, max_lora_rank=a.rank),
    )
    names = [f"adapter{i}" for i in range(a.adapters)]
    with tempfile.TemporaryDirectory(prefix="bench_lora_step_") as tmp:
        for i, name in enumerate(names):
            runner.lora.load(name, random_peft_adapter(model_dir, f"{tmp}/{name}", a.rank, seed=i, std=0.01))
        print("| round | batch-1 base / adapter ms | ÷ | batch-16 base / mixed ms | ÷ |")
        print("|---|---|---|---|---|")
        for r in range(a.rounds):
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
            cycle = [*names, None]
            one = [Group(runner, [None]), Group(runner, [names[0]])]
            sixteen = [
                Group(runner, [None] * MIXED_BATCH),
                Group(runner, [cycle[i % len(cycle)] for i in range(MIXED_BATCH)]),
            ]
            base1, adapter1 = paired_steps(one, a.steps)
            base, mixed = paired_steps(sixteen, max(a.steps // 4, 2 * WARMUP_STEPS))
            print(
                f"| {r + 1} | {base1 * 1e3:.2f} / {adapter1 * 1e3:.2f} | {base1 / adapter1:.3f} | "
                f"{base * 1e3:.2f} / {mixed * 1e3:.2f} | {base / mixed:.3f} |"
            )


if __name__ == "__main__":
    main()
