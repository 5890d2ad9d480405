"""A long prompt's prefill alone and with short requests arriving during it, through a real server: the
figures of the rule that lets waiting prompts go ahead of a long prompt's chunks (docs/cpu_execution.md,
"Long prompts").

    .venv/bin/python scripts/bench_long_prompt.py [--long-len 6300] [--shorts 4] [--first-arrival 3]
        [--interval 2] [--server-args '--max-total-tokens 16384']

Starts `srt.launch_server` on the embedded SmolLM2 (or `--model-path`), then:

1. warms it: `--warm` short requests one by one (their time to first token is the baseline a short request
   has alone), then two at once, so the step-cost model has measured its per-token cost as on a server that
   has served a while;
2. sends a `--long-len`-token prompt alone (one output token: its time is its prefill);
3. sends another such prompt and, `--first-arrival` seconds later and every `--interval` seconds after,
   `--shorts` short requests of `--short-len` tokens.

Prints the long prompt's time alone and with the others (their ratio: the target is at most 1.2) and each
short request's time to first token against the baseline (the target: at most one prefill step of about
1 s, `LONE_PREFILL_STEP_SECONDS`, plus its own time). Prompts are random ordinary token ids, fresh for every
request, so no request hits another's cached prefix. Times to first token are the server's (`return_timing`:
arrival to first output); the long prompt's times are the client's. One machine's figures: on a shared CPU
they move with whatever else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import re
import statistics
import tempfile
import time

import httpx

from srt.model_source import resolve_model_dir
from srt.scheduler.mixed_chunk import LONE_PREFILL_STEP_SECONDS, MIN_LONE_PREFILL_TOKENS
from srt.scheduler.step_executor import STEP_DEBUG_LINE
from srt_bench.server import launch_server, wait_healthy

SEED = 0
TOKEN_RANGE = (100, 40000)  # ordinary tokens of SmolLM2's vocabulary
REQUEST_TIMEOUT_S = 1800.0  # a long prompt on a busy 2-core CPU takes minutes
TARGET_RATIO = 1.2  # the long prompt's time with others over alone


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-len", type=int, default=6300, help="the long prompt's tokens (128 tools: ~6,300)")
    ap.add_argument("--shorts", type=int, default=4, help="short requests sent during the long prefill")
    ap.add_argument("--short-len", type=int, default=24, help="a short request's prompt tokens")
    ap.add_argument("--short-max-tokens", type=int, default=8, help="a short request's output tokens")
    ap.add_argument("--first-arrival", type=float, default=3.0, help="seconds after the long prompt")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between short requests")
    ap.add_argument("--warm", type=int, default=3, help="short requests sent one by one first")
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--server-args", default="", help="extra srt flags, e.g. '--max-total-tokens 16384'")
    ap.add_argument("--log-dir", default=None, help="the server's log; default: a temporary directory")
    return ap.parse_args()


class Client:
    def __init__(self, http: httpx.AsyncClient, seed: int):
        self.http = http
        self.rng = random.Random(seed)

    async def complete(self, prompt_len: int, max_tokens: int) -> dict:
        """One /v1/completions request of a fresh random prompt: the client's seconds and the server's
        timing of it."""
        body = {
            "prompt": [self.rng.randrange(*TOKEN_RANGE) for _ in range(prompt_len)],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_timing": True,
        }
        start = time.monotonic()
        resp = await self.http.post("/v1/completions", json=body)
        seconds = time.monotonic() - start
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        return {"seconds": seconds, "sent": start, **choice["timing"]}


async def bench(url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        client = Client(http, SEED)
        baseline = [await client.complete(args.short_len, args.short_max_tokens) for _ in range(args.warm)]
        await asyncio.gather(*(client.complete(args.short_len, args.short_max_tokens) for _ in range(2)))
        alone = await client.complete(args.long_len, 1)

        long_task = asyncio.create_task(client.complete(args.long_len, 1))
        start = time.monotonic()
        shorts = []
        for i in range(args.shorts):
            await asyncio.sleep(max(0.0, start + args.first_arrival + i * args.interval - time.monotonic()))
            shorts.append(asyncio.create_task(client.complete(args.short_len, args.short_max_tokens)))
        shared = await long_task
        return {
            "baseline": baseline,
            "alone": alone,
            "shared": shared,
            "shorts": await asyncio.gather(*shorts),
        }


def report(r: dict, args: argparse.Namespace) -> None:
    base_ttft = statistics.median(b["time_to_first_token"] for b in r["baseline"])
    alone, shared = r["alone"]["seconds"], r["shared"]["seconds"]
    print(
        f"long prompt ({args.long_len} tokens, 1 output token): alone {alone:.2f} s, with "
        f"{len(r['shorts'])} short requests {shared:.2f} s, ratio {shared / alone:.2f} (target <= {TARGET_RATIO})"
    )
    print(
        f"short requests ({args.short_len} prompt tokens, {args.short_max_tokens} output tokens): time to first "
        f"token alone {base_ttft:.3f} s (median of {len(r['baseline'])}); target: at most one prefill step "
        f"(~{LONE_PREFILL_STEP_SECONDS:.0f} s) more"
    )
    long_end = r["shared"]["sent"] + shared
    for i, s in enumerate(r["shorts"]):
        during = "during the long prefill" if s["sent"] < long_end else "after the long prompt ended"
        print(
            f"  short {i}: sent {s['sent'] - r['shared']['sent']:.1f} s after the long prompt ({during}): "
            f"TTFT {s['time_to_first_token']:.3f} s, wait beyond alone {s['time_to_first_token'] - base_ttft:.3f} s, "
            f"queue {s['queue_time']:.3f} s, e2e {s['seconds']:.3f} s"
        )


def step_times(log_text: str) -> list[tuple[int, int, float]]:
    """(prefill tokens, decode rows, forward seconds) of every step in a server log at --log-level debug."""
    pattern = re.escape(STEP_DEBUG_LINE).replace("%d", r"(\d+)").replace(r"%\.1f", r"([\d.]+)")
    return [(int(p), int(d), float(ms) / 1e3) for p, d, ms in re.findall(pattern, log_text)]


def report_steps(steps: list[tuple[int, int, float]]) -> None:
    """The steps that continued the long prompt, against the budget an arrival waits for at most."""
    chunks = [s for p, _, s in steps if p >= MIN_LONE_PREFILL_TOKENS]
    if not chunks:
        print("no step of the long prompt in the server's log")
        return
    over = [s for s in chunks if s > LONE_PREFILL_STEP_SECONDS]
    print(
        f"prefill steps of >= {MIN_LONE_PREFILL_TOKENS} tokens (the long prompts' chunks): {len(chunks)}, "
        f"median {statistics.median(chunks):.2f} s, max {max(chunks):.2f} s against the "
        f"{LONE_PREFILL_STEP_SECONDS:.0f}-s budget; {len(over)} over it"
        + (f" (by up to {max(over) / LONE_PREFILL_STEP_SECONDS - 1:.0%})" if over else "")
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [bench_long_prompt] %(message)s")
    args = parse_args()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_long_prompt-")
    os.makedirs(log_dir, exist_ok=True)
    # debug: the scheduler logs each step's forward time (report_steps)
    extra = args.server_args.split()
    flags = ("--model-path", resolve_model_dir(args.model_path), "--log-level", "debug", *extra)
    server = launch_server(*flags, wait=False, log_path=os.path.join(log_dir, "server.log"))
    try:
        ready_s = wait_healthy(server)
        logging.info("server ready in %.0f s (log: %s)", ready_s, server.log_path)
        results = asyncio.run(bench(server.base_url, args))
    finally:
        server.stop()
    report(results, args)
    with open(server.log_path, errors="replace") as f:
        report_steps(step_times(f.read()))


if __name__ == "__main__":
    main()
