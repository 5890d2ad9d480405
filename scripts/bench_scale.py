"""The scale ladder: srt and llama.cpp's server on the same GGUF files, one server at a time.

For each file and each server: a cold start (srt with an empty cache directory; the file's pages dropped from
the page cache first, where the kernel allows), the workloads, a stop, then a warm start (same cache, file
in the page cache). Printed per row: cold and warm seconds to the first answer (a one-token request
succeeding), peak resident memory of all the server's processes (the sum of their VmHWM), disk the server
wrote to its cache, batch-1 decode tok/s (1 / median time per output token, prompts one at a time), and
output tok/s at concurrency 16.

Random-weight files of real shapes come from scripts/make_random_gguf.py:

    python scripts/make_random_gguf.py /tmp/tinyllama-q4_k_m.gguf --preset tinyllama-1.1b --mix q4_k_m
    python scripts/make_random_gguf.py /tmp/llama2-7b-q4_k_m.gguf --preset llama2-7b --mix q4_k_m
    python scripts/bench_scale.py /tmp/tinyllama-q4_k_m.gguf /tmp/llama2-7b-q4_k_m.gguf

Slow by nature (a 7B file takes tens of minutes on 2 cores): a benchmark, never part of the test suite. Both
servers get the same prompts through the completions endpoint, with a fixed output length (srt `ignore_eos`,
llama.cpp `min_tokens`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

from srt.model_source import CACHE_DIR_ENV
from srt.tokenizer_loading import load_tokenizer
from srt_bench.dataset import random_requests
from srt_bench.peers import (
    llama_cpp_peer,
    machine_description,
    srt_peer,
    start_peer,
    stop_peer,
    wait_peer_ready,
)
from srt_bench.runner import run_benchmark
from srt_bench.server import ServerHandle

logger = logging.getLogger("bench_scale")

SERVERS = ("srt", "llama.cpp")
BASE_PORT = 30300
GIB = 1024**3


@dataclasses.dataclass
class Row:
    file: str
    server: str
    file_gib: float
    cold_s: float | None = None
    warm_s: float | None = None
    peak_rss_gib: float | None = None
    disk_mib: float | None = None
    batch1_tok_s: float | None = None
    conc_tok_s: float | None = None
    error: str | None = None


def drop_from_page_cache(path: str) -> bool:
    """Ask the kernel to forget the file's cached pages (a cold start reads it from disk); False where the
    kernel does not drop them (pages mapped by a live process stay)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def disk_bytes(directory: str) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def make_peer(server: str, port: int, path: str, cache_dir: str):
    if server == "srt":
        peer = srt_peer(port, path)
        peer.env[CACHE_DIR_ENV] = cache_dir
    else:
        peer = llama_cpp_peer(port, path)
    peer.target = dataclasses.replace(peer.target, endpoint="completions")
    return peer


async def start_and_time(peer, log_path: str, count_tokens) -> tuple[ServerHandle, float]:
    """A started peer and its seconds to ready (it is killed if it fails to get there)."""
    server = start_peer(peer, log_path)
    return server, await wait_peer_ready(server, peer, count_tokens)


async def bench_one(path: str, server_name: str, args, tokenizer, log_dir: str) -> Row:
    row = Row(os.path.basename(path), server_name, os.path.getsize(path) / GIB)
    cache_dir = tempfile.mkdtemp(prefix="srt-scale-cache-")
    count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    batch1 = random_requests(tokenizer, args.batch1_prompts, args.input_len, args.output_len, 1.0, 1, False)
    conc = random_requests(tokenizer, args.conc_prompts, args.input_len, args.output_len, 1.0, 2, False)
    try:
        peer = make_peer(server_name, args.port, path, cache_dir)
        if peer.missing:
            row.error = peer.missing
            return row
        dropped = drop_from_page_cache(path)
        logger.info("%s on %s: cold start (page cache dropped: %s)", server_name, row.file, dropped)
        server, row.cold_s = await start_and_time(
            peer, os.path.join(log_dir, f"{server_name}-cold.log"), count_tokens
        )
        try:
            run = await run_benchmark(
                peer.target, batch1, count_tokens, max_concurrency=1, show_progress=False
            )
            if run.summary.completed:
                row.batch1_tok_s = 1000.0 / run.summary.tpot.median_ms
            run = await run_benchmark(
                peer.target, conc, count_tokens, max_concurrency=args.concurrency, show_progress=False
            )
            row.conc_tok_s = run.summary.output_throughput
        finally:
            row.peak_rss_gib = stop_peer(server) / GIB
        row.disk_mib = disk_bytes(cache_dir) / 2**20
        server, row.warm_s = await start_and_time(
            peer, os.path.join(log_dir, f"{server_name}-warm.log"), count_tokens
        )
        row.peak_rss_gib = max(row.peak_rss_gib, stop_peer(server) / GIB)
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
        row.error = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return row


def table(rows: list[Row], concurrency: int) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [
        f"| file | server | file GiB | cold s | warm s | peak RSS GiB | cache MiB | batch-1 tok/s | c{concurrency} tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.file} | {r.server} | {r.file_gib:.2f} | {r.error[:120]} |||||||")
            continue
        lines.append(
            f"| {r.file} | {r.server} | {r.file_gib:.2f} | {f(r.cold_s, '.1f')} | {f(r.warm_s, '.1f')} | "
            f"{f(r.peak_rss_gib, '.2f')} | {f(r.disk_mib, '.1f')} | {f(r.batch1_tok_s, '.1f')} | "
            f"{f(r.conc_tok_s, '.1f')} |"
        )
    return "\n".join(lines)


def ratios(rows: list[Row]) -> str:
    """srt / llama.cpp per file, for the issue's targets."""
    out = []
    for file in dict.fromkeys(r.file for r in rows):
        by = {r.server: r for r in rows if r.file == file and not r.error}
        s, ll = by.get("srt"), by.get("llama.cpp")
        if s is None or ll is None:
            continue
        parts = []
        if s.batch1_tok_s and ll.batch1_tok_s:
            parts.append(f"batch 1 {s.batch1_tok_s / ll.batch1_tok_s:.2f}x")
        if s.conc_tok_s and ll.conc_tok_s:
            parts.append(f"concurrency {s.conc_tok_s / ll.conc_tok_s:.2f}x")
        if s.peak_rss_gib and ll.peak_rss_gib:
            parts.append(f"peak RSS {s.peak_rss_gib / ll.peak_rss_gib:.2f}x")
        out.append(f"{file}: srt / llama.cpp " + ", ".join(parts))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", nargs="+", help="GGUF files, served one at a time")
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch1-prompts", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--conc-prompts", type=int, default=16)
    p.add_argument("--port", type=int, default=BASE_PORT)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--output-file", default=None, help="JSON of every row")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[bench_scale] %(message)s")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench-scale-logs-")
    os.makedirs(log_dir, exist_ok=True)
    rows = []
    for path in args.gguf:
        tokenizer = load_tokenizer(path)
        for server in args.servers.split(","):
            started = time.monotonic()
            row = asyncio.run(bench_one(path, server, args, tokenizer, log_dir))
            logger.info("%s (%.0f s): %s", server, time.monotonic() - started, row)
            rows.append(row)
    print(f"\n{machine_description()}; logs in {log_dir}\n")
    print(table(rows, args.concurrency))
    print()
    print(ratios(rows))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
