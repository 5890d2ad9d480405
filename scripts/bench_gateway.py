"""srt behind the Shepherd Model Gateway (`smg`): what the gateway costs and what cache-aware routing buys.

    python scripts/bench_gateway.py                     # two workers and the gateway on this machine
    python scripts/bench_gateway.py --num-prompts 2     # a smoke run

Starts two srt workers on the embedded model, then prints, from one run:
- the gateway's overhead: TTFT and E2E medians at concurrency 1, chat streamed through a `round_robin`
  gateway against the same requests sent to a worker directly (alternating, so both see the same machine);
- the prefix-cache hit rate summed over both workers (srt's `/metrics`) on the shared-prefix workload of
  scripts/srt_bench/gateway.py, with `--policy cache_aware` against `round_robin`, caches flushed before each.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time

import httpx

from srt.model_source import DEFAULT_EMBEDDED_MODEL, resolve_model_dir
from srt.sockets import find_free_port
from srt_bench.backends import Target
from srt_bench.dataset import BenchRequest, load_tokenizer, random_requests
from srt_bench.gateway import (
    CACHE_AWARE,
    ROUND_ROBIN,
    prefix_counters,
    prefix_hit_rate,
    running_gateway,
    shared_prefix_prompts,
    smg_problem,
)
from srt_bench.peers import srt_peer, start_peer, wait_peer_ready
from srt_bench.runner import run_benchmark

logger = logging.getLogger("bench_gateway")

WORKERS = 2
# Scheduler counters reach /metrics within about a second of the last step (srt/metrics/load_snapshot.py).
SETTLE_SECONDS = 1.5
HIT_RATE_OUTPUT_TOKENS = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_EMBEDDED_MODEL, help="what the workers serve")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per side of the overhead run")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--groups", type=int, default=3, help="shared prefixes (odd: round robin splits each)")
    p.add_argument("--per-group", type=int, default=6, help="questions per prefix")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="each worker's KV pool")
    p.add_argument("--seed", type=int, default=0)
    return p


async def overhead(
    gateway_url: str, direct_url: str, model: str, requests: list[BenchRequest], count_tokens
) -> dict:
    """TTFT and E2E medians (ms) through the gateway and direct, one request at a time, alternating."""
    runs = {"gateway": [], "direct": []}
    for req in requests:
        for name, url in (("gateway", gateway_url), ("direct", direct_url)):
            target = Target(url, backend="openai", endpoint="chat", model=model, fixed_output="ignore_eos")
            result = await run_benchmark(target, [req], count_tokens, max_concurrency=1, show_progress=False)
            runs[name].extend(result.results)
    out = {}
    for name, results in runs.items():
        failed = [r for r in results if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed {name}; first: {failed[0].error}")
        ttft = sorted(r.ttft for r in results)
        e2e = sorted(r.e2e for r in results)
        out[name] = (1000 * ttft[len(ttft) // 2], 1000 * e2e[len(e2e) // 2])
    return out


def hit_rate(worker_urls: list[str], model: str, policy: str, prompts: list[str]) -> float:
    with running_gateway(worker_urls, policy) as gw:
        httpx.post(f"{gw.base_url}/flush_cache", timeout=60).raise_for_status()
        before = [prefix_counters(httpx.get(f"{u}/metrics", timeout=10).text) for u in worker_urls]
        with httpx.Client(base_url=gw.base_url, timeout=300) as client:
            for p in prompts:
                body = {"model": model, "prompt": p, "max_tokens": HIT_RATE_OUTPUT_TOKENS, "temperature": 0}
                client.post("/v1/completions", json=body).raise_for_status()
        time.sleep(SETTLE_SECONDS)
        after = [prefix_counters(httpx.get(f"{u}/metrics", timeout=10).text) for u in worker_urls]
    return prefix_hit_rate(before, after)


async def main(args: argparse.Namespace) -> int:
    problem = smg_problem()
    if problem is not None:
        logger.error("%s", problem)
        return 2
    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    flags = ("--max-total-tokens", str(args.max_total_tokens))
    peers = [srt_peer(find_free_port(), model_dir, *flags, name=f"worker{i}") for i in range(WORKERS)]
    logs = tempfile.mkdtemp(prefix="bench-gateway-")
    servers = [start_peer(p, f"{logs}/{p.name}.log") for p in peers]
    try:
        for s, p in zip(servers, peers, strict=True):
            await wait_peer_ready(s, p, count_tokens)
        urls = [p.target.base_url for p in peers]
        model = httpx.get(f"{urls[0]}/v1/models", timeout=10).json()["data"][0]["id"]  # the gateway needs it
        requests = random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, 0.0,
                                   args.seed, chat=True)  # fmt: skip
        with running_gateway(urls, ROUND_ROBIN) as gw:
            medians = await overhead(gw.base_url, urls[0], model, requests, count_tokens)
        prompts = shared_prefix_prompts(args.groups, args.per_group)
        rates = {policy: hit_rate(urls, model, policy, prompts) for policy in (CACHE_AWARE, ROUND_ROBIN)}
    finally:
        for s in servers:
            s.stop()
    print(f"gateway overhead at concurrency 1 ({args.num_prompts} chat requests, {args.input_len} tokens in, "
          f"{args.output_len} out, each sent through smg and direct):")  # fmt: skip
    for name, (ttft, e2e) in medians.items():
        print(f"  {name:8s} TTFT p50 {ttft:8.1f} ms   E2E p50 {e2e:8.1f} ms")
    print(
        f"prefix-cache hit rate over {WORKERS} workers ({args.groups} prefixes x {args.per_group} questions):"
    )
    for policy, rate in rates.items():
        print(f"  {policy:12s} {rate:.3f}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    sys.exit(asyncio.run(main(build_parser().parse_args())))
