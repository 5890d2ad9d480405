"""Multi-LoRA serving on srt: what adapters cost next to the base model, on the embedded SmolLM2.

Makes `--num-adapters` random rank-`--rank` adapters on every target module with PEFT (in a temporary
directory), then starts two servers side by side (an idle server takes no CPU):
- `srt`: no LoRA (the reference of every ratio);
- `srt-lora`: the same server with the adapters loaded (`--lora-paths`).
Each of `--rounds` rounds runs every workload on `srt`, then on `srt-lora`, so the servers take turns and a
drift of the machine's speed (up to 15 % between runs a few minutes apart on the 2-core VMs measured) falls
on both; the table gives each workload's median round.
Workloads (bench_peers' random chat workload, fixed output length):
- `mixed`: at `--concurrency`, each request the base or one of the adapters, uniformly (on srt-lora; the
  reference runs the same requests on the base);
- `batch1-base` / `batch1-adapter`: one request at a time, on the base and on one adapter.
The table gives output tok/s (each workload's median round) and the ratios the targets name, each the
median of the rounds' own ratios: mixed ÷ base-only at the same concurrency (target ≥ 0.8), adapter
batch-1 ÷ base batch-1 (target ≥ 0.85; also against the base on the LoRA server, per round). With
`--paired` the batch-1 workloads go request by request, each prompt on srt's base, the LoRA server's base and
its adapter in turn, so the machine's drift falls on all three alike. A benchmark, never part of the tests;
run it on a quiet machine.

    python scripts/bench_lora.py
    python scripts/bench_lora.py --num-adapters 4 --rank 16 --concurrency 16 --num-prompts 64
    python scripts/bench_lora.py --paired   # batch-1 figures paired request by request (steadier)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import tempfile
from contextlib import ExitStack
from dataclasses import replace

import httpx

from srt.model_source import resolve_model_dir
from srt_bench.dataset import load_tokenizer, random_requests
from srt_bench.lora_adapters import random_peft_adapter
from srt_bench.peers import machine_description, running_peer, srt_peer, wait_peer_ready
from srt_bench.runner import run_benchmark, run_interleaved, warmup

logger = logging.getLogger("bench_lora")

BASE_PORT = 30400
TARGET_MIXED, TARGET_BATCH1 = 0.8, 0.85


def make_adapters(model_dir: str, out: str, num: int, rank: int) -> dict[str, str]:
    """Random adapters (B != 0) of `rank` on every target module, saved by PEFT."""
    return {
        f"adapter{i}": random_peft_adapter(
            model_dir, os.path.join(out, f"adapter{i}"), rank, seed=i, std=0.01
        )
        for i in range(num)
    }


async def measure(peer, count_tokens, workloads, show_progress) -> dict[str, float]:
    """Output tok/s of each workload on one running server, each from an empty prefix cache (a round
    repeats the prompts of the one before: it would otherwise skip their prefill)."""
    out = {}
    for name, (requests, concurrency) in workloads.items():
        await warmup(peer.target, requests[0], count_tokens)
        httpx.post(f"{peer.target.base_url}/flush_cache", timeout=60).raise_for_status()
        run = await run_benchmark(
            peer.target, requests, count_tokens, max_concurrency=concurrency, show_progress=show_progress
        )
        s = run.summary
        logger.info("%s %s: %d ok, %d failed, %.1f output tok/s", peer.name, name, s.completed, s.failed,
                    s.output_throughput)  # fmt: skip
        out[name] = s.output_throughput if s.failed == 0 else float("nan")
    return out


async def measure_batch1_paired(plain, lora, one, adapter, count_tokens) -> dict:
    """The batch-1 workloads paired request by request (`run_interleaved`): each prompt on srt's base, then
    on the LoRA server's base, then on its adapter, each server from an empty prefix cache: output tok/s
    per server and workload."""
    for peer in (plain, lora):
        await warmup(peer.target, one[0], count_tokens)
        httpx.post(f"{peer.target.base_url}/flush_cache", timeout=60).raise_for_status()
    arms = [
        [(plain.target, r) for r in one],
        [(lora.target, r) for r in one],
        [(lora.target, replace(r, lora=adapter)) for r in one],
    ]
    runs = await run_interleaved(arms, count_tokens)
    tps = [run.summary.output_throughput if run.summary.failed == 0 else float("nan") for run in runs]
    names = ("srt batch1-base", "srt-lora batch1-base", "srt-lora batch1-adapter")
    for name, value in zip(names, tps, strict=True):
        logger.info("%s (paired): %.1f output tok/s", name, value)
    return {"srt": {"batch1-base": tps[0]}, "srt-lora": {"batch1-base": tps[1], "batch1-adapter": tps[2]}}


async def main_async(args) -> None:
    model_dir = resolve_model_dir(None)
    tokenizer = load_tokenizer(model_dir)
    count_tokens = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        adapters = make_adapters(model_dir, tmp, args.num_adapters, args.rank)
        rng = random.Random(args.seed)
        base = random_requests(
            tokenizer, args.num_prompts, args.input_len, args.output_len, 1.0, args.seed, True
        )
        choices = [None, *adapters]
        mixed = [replace(r, lora=rng.choice(choices)) for r in base]
        one = base[: args.batch1_prompts]
        first = next(iter(adapters))
        plain = srt_peer(args.base_port, model_dir, name="srt")
        lora_flags = [
            "--lora-paths",
            *(f"{n}={p}" for n, p in adapters.items()),
            "--max-lora-rank",
            str(args.rank),
        ]
        lora = srt_peer(args.base_port + 1, model_dir, *lora_flags, name="srt-lora")
        workloads = {
            "srt": {"mixed": (base, args.concurrency), "batch1-base": (one, 1)},
            "srt-lora": {
                "mixed": (mixed, args.concurrency),
                "batch1-base": (one, 1),
                "batch1-adapter": ([replace(r, lora=first) for r in one], 1),
            },
        }
        rounds: list[dict[str, dict[str, float]]] = []
        with ExitStack() as stack:
            for peer in (plain, lora):
                server = stack.enter_context(running_peer(peer, os.path.join(tmp, f"{peer.name}.log")))
                ready_s = await wait_peer_ready(server, peer, count_tokens)
                logger.info("%s ready after %.1f s", peer.name, ready_s)
            for _ in range(args.rounds):
                if not args.paired:
                    rounds.append(
                        {
                            peer.name: await measure(
                                peer, count_tokens, workloads[peer.name], not args.disable_tqdm
                            )
                            for peer in (plain, lora)
                        }
                    )
                    continue
                mixed_only = {p.name: {"mixed": workloads[p.name]["mixed"]} for p in (plain, lora)}
                figures = {
                    p.name: await measure(p, count_tokens, mixed_only[p.name], not args.disable_tqdm)
                    for p in (plain, lora)
                }
                for server, values in (
                    await measure_batch1_paired(plain, lora, one, first, count_tokens)
                ).items():
                    figures[server].update(values)
                rounds.append(figures)
    results = {
        server: {w: statistics.median(r[server][w] for r in rounds) for w in runs}
        for server, runs in workloads.items()
    }
    print(f"\nMachine: {machine_description()}")
    print(
        f"Model: SmolLM2-135M-Instruct (int8), {args.num_adapters} adapters of rank {args.rank} on every module"
    )
    print(f"Random chat workload: input {args.input_len} / output {args.output_len} tokens, fixed length; "
          f"{args.rounds} rounds, each cell its workload's median\n")  # fmt: skip
    print("| server | workload | output tok/s |\n|---|---|---|")
    for server, runs in results.items():
        for workload, tps in runs.items():
            print(f"| {server} | {workload} | {tps:.1f} |")
    # each ratio the median of the rounds' own ratios: a round's two figures met the same minutes of the machine
    mixed_ratio = statistics.median(r["srt-lora"]["mixed"] / r["srt"]["mixed"] for r in rounds)
    batch1_ratio = statistics.median(
        r["srt-lora"]["batch1-adapter"] / r["srt"]["batch1-base"] for r in rounds
    )
    print(f"\n- mixed (base + adapters, c{args.concurrency}) / base-only: {mixed_ratio:.2f}x "
          f"(target {TARGET_MIXED}x: {'met' if mixed_ratio >= TARGET_MIXED else 'MISSED'})")  # fmt: skip
    print(f"- batch-1 adapter / base: {batch1_ratio:.2f}x "
          f"(target {TARGET_BATCH1}x: {'met' if batch1_ratio >= TARGET_BATCH1 else 'MISSED'})")  # fmt: skip
    on_lora = statistics.median(r["srt-lora"]["batch1-base"] / r["srt"]["batch1-base"] for r in rounds)
    print(f"- base batch-1 on the LoRA server / without LoRA: {on_lora:.2f}x")
    same = [r["srt-lora"]["batch1-adapter"] / r["srt-lora"]["batch1-base"] for r in rounds]
    print(f"- batch-1 adapter / base on the LoRA server, per round: {', '.join(f'{x:.2f}x' for x in same)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--batch1-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--rounds", type=int, default=3, help="every workload this many times, the servers in turn"
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="batch-1 workloads request by request: each prompt on srt's base, the LoRA server's base, then its adapter",
    )
    p.add_argument("--base-port", type=int, default=BASE_PORT)
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
