"""srt against the servers a user could run instead, on the same machine and the same embedded SmolLM2.

Starts, one after another: srt (`python -m srt.launch_server`), `transformers serve --continuous-batching`
(fp32; extra `transformers[serving]`) and llama.cpp's server from `llama-cpp-python[server]` on the GGUF
(skipped with a message when not installed). Each gets the same greedy workloads with fixed lengths
(input 256, output 64 tokens) at concurrency 1, 16 and 64, and one table compares them, with srt's ratio to
each peer. Slow by nature (tens of minutes on 2 cores): a benchmark, never part of the test suite. On a
noisy machine one run's ratio says little: `--rounds N` runs the peers N times, taking turns, and reports
each level's median run and every round's figure.

    python scripts/bench_peers.py                                   # all peers, the issue's workloads
    python scripts/bench_peers.py --peers srt,llama.cpp --plot /tmp/peers --output-file peers.json
    python scripts/bench_peers.py --peers srt,llama.cpp --concurrency 64 --num-prompts 64 --rounds 3
    git worktree add /tmp/before <commit> && python scripts/bench_peers.py --peers srt --before-tree /tmp/before \
        --concurrency 16 --num-prompts 32 --rounds 5          # this tree against an earlier one, paired
    python scripts/bench_peers.py --model gemma3-270m --endpoint completions --peers srt,llama.cpp \
        --concurrency 1,16 --num-prompts 8,32

A pretrained (not instruction-tuned) model such as Gemma 3 270M has no chat to hold: `--endpoint completions`
sends the prompts as plain text (llama-cpp-python's chat format for it answers with no content at all).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import tempfile

from srt.model_source import DEFAULT_EMBEDDED_MODEL, EMBEDDED_MODELS, embedded_gguf_path, resolve_model_dir
from srt_bench.dataset import load_tokenizer, random_requests
from srt_bench.peers import (
    comparison_table,
    llama_cpp_peer,
    machine_description,
    median_runs,
    rounds_table,
    srt_before_peer,
    srt_fp32_peer,
    srt_peer,
    start_peer,
    stop_peer,
    transformers_peer,
    wait_peer_ready,
)
from srt_bench.plot import plot_sweep
from srt_bench.report import format_server_comparison
from srt_bench.runner import RunResult, run_benchmark, warmup

logger = logging.getLogger("bench_peers")

# llama.cpp before transformers: the slowest peer last, so a cut-short run still compares most of them.
PEER_FACTORIES = {
    "srt": srt_peer,  # the converted directory, default flags: w8a8_int8 (GPTQ-calibrated) on the CPU
    "srt-gguf": lambda port, path: srt_peer(port, path, name="srt-gguf"),  # the GGUF, default flags
    "srt-gguf-blocks": lambda port, path: srt_peer(
        port, path, "--quantization", "gguf", name="srt-gguf-blocks"
    ),
    "srt-fp32": srt_fp32_peer,
    "llama.cpp": llama_cpp_peer,
    "transformers": transformers_peer,
}
# the peers served from the embedded model's GGUF (the others read its converted directory)
GGUF_PEERS = ("srt-gguf", "srt-gguf-blocks", "llama.cpp")
# the peers run when --peers is not given (the GGUF methods of srt on request)
DEFAULT_PEERS = ("srt", "srt-fp32", "llama.cpp", "transformers")
BASE_PORT = 30100


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--peers",
        default=",".join(DEFAULT_PEERS),
        help=f"comma-separated, run in order, of: {', '.join(PEER_FACTORIES)}",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_EMBEDDED_MODEL,
        choices=sorted(EMBEDDED_MODELS),
        help="the embedded model every peer serves (llama.cpp its GGUF, the others its converted directory)",
    )
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    p.add_argument("--num-prompts", default="8,32,64", help="requests per level, one number per level")
    p.add_argument("--endpoint", default="chat", choices=("chat", "completions"))
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--base-port", type=int, default=BASE_PORT)
    p.add_argument("--log-dir", default=None, help="server logs; default: a temporary directory")
    p.add_argument("--output-file", default=None, help="JSON with every run's summary and request timings")
    p.add_argument("--plot", default=None, metavar="DIR", help="throughput / p99 vs concurrency charts")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every peer this many times, taking turns (odd: a true median); the tables then show each "
        "level's median run, and a table of every round's output tok/s follows",
    )
    p.add_argument(
        "--before-tree",
        default=None,
        metavar="DIR",
        help="another checkout of srt (e.g. `git worktree add DIR <commit>`): adds the peer srt-before, srt "
        "with default flags run from DIR, to compare two versions in one run (with --rounds: paired)",
    )
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


async def bench_peer(
    peer, levels, counts, dataset, count_tokens, log_path, show_progress, runs, peak_rss
) -> None:
    """Start one server, warm it up with one full-size request, run every level into `runs`, stop it (its
    peak RSS goes into `peak_rss`, the largest of any round). Appending as it goes keeps the finished levels
    when interrupted."""
    server = start_peer(peer, log_path)
    try:
        await _bench_levels(server, peer, levels, counts, dataset, count_tokens, show_progress, runs)
    finally:
        peak_rss[peer.name] = max(peak_rss.get(peer.name, 0), stop_peer(server))


async def _bench_levels(server, peer, levels, counts, dataset, count_tokens, show_progress, runs) -> None:
    ready_s = await wait_peer_ready(server, peer, count_tokens)
    logger.info("%s ready after %.1f s", peer.name, ready_s)
    warm = await warmup(peer.target, dataset[0], count_tokens)
    if not warm.success:
        raise RuntimeError(f"{peer.name} warm-up failed: {warm.error}")
    offset = 1
    for level, count in zip(levels, counts, strict=True):
        requests = dataset[offset : offset + count]
        offset += count
        run = await run_benchmark(
            peer.target, requests, count_tokens, max_concurrency=level, show_progress=show_progress
        )
        s = run.summary
        logger.info(
            "%s conc %d: %d ok, %d failed, %.1f output tok/s, TTFT p50 %.2f s, ITL p50 %.0f ms",
            peer.name, level, s.completed, s.failed, s.output_throughput, s.ttft.median_ms / 1000,
            s.itl.median_ms,
        )  # fmt: skip
        runs.append(run)


async def main_async(args: argparse.Namespace) -> tuple[list[dict[str, list[RunResult]]], dict[str, int]]:
    levels, counts = _ints(args.concurrency), _ints(args.num_prompts)
    if len(levels) != len(counts):
        raise SystemExit("--num-prompts needs one count per --concurrency level")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    # Same prompts for every server, fresh ones for every level (no prefix-cache hits across levels).
    dataset = random_requests(
        tokenizer, 1 + sum(counts), args.input_len, args.output_len, 1.0, args.seed, args.endpoint == "chat"
    )
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_peers_")
    os.makedirs(log_dir, exist_ok=True)
    names = args.peers.split(",")
    factories = dict(PEER_FACTORIES)
    if args.before_tree:
        factories["srt-before"] = functools.partial(srt_before_peer, tree=args.before_tree)
        names = names if "srt-before" in names else [*names, "srt-before"]
    for name in names:
        if name not in factories:
            raise SystemExit(f"unknown peer {name!r}; choose from {', '.join(factories)}")
    rounds: list[dict[str, list[RunResult]]] = []
    peak_rss: dict[str, int] = {}
    # Ctrl-C or SIGTERM stops the current server cleanly and still prints what was measured.
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    interrupted = False
    for r in range(args.rounds):
        results: dict[str, list[RunResult]] = {}
        rounds.append(results)
        for i, name in enumerate(names):
            source = embedded_gguf_path(args.model) if name in GGUF_PEERS else model_dir
            peer = factories[name](args.base_port + i, source)
            peer.target = dataclasses.replace(peer.target, endpoint=args.endpoint)
            if peer.missing:
                if r == 0:
                    logger.warning("%s", peer.missing)
                continue
            log_name = f"{name}.log" if args.rounds == 1 else f"{name}-round{r + 1}.log"
            runs = results.setdefault(name, [])
            try:
                await bench_peer(
                    peer, levels, counts, dataset, count_tokens, os.path.join(log_dir, log_name),
                    not args.disable_tqdm, runs, peak_rss,
                )  # fmt: skip
            except (RuntimeError, TimeoutError) as exc:
                logger.error("%s could not be benchmarked: %s", name, exc)
            except asyncio.CancelledError:
                logger.warning("interrupted during %s: reporting what was measured so far", name)
                interrupted = True
                break
        if interrupted:
            break
    rounds = [{name: runs for name, runs in results.items() if runs} for results in rounds]
    return [results for results in rounds if results], peak_rss


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    rounds, peak_rss = asyncio.run(main_async(args))
    if not rounds:
        logger.error("no server could be benchmarked")
        return 1
    results = median_runs(rounds)
    print(f"\nMachine: {machine_description()}")
    print(
        f"Model: {args.model}. Workload: input {args.input_len} / output {args.output_len} tokens, greedy, fixed output length, "
        f"{args.endpoint} endpoint; prompts per level {args.num_prompts}\n"
    )
    if len(rounds) > 1:
        print(f"Each level's median run of {len(rounds)} rounds:\n")
    print(comparison_table(results))
    if len(rounds) > 1:
        print(f"\nOutput tok/s, round by round:\n\n{rounds_table(rounds)}")
    for name, rss in peak_rss.items():
        if name in results:
            scope = "all levels" if len(rounds) == 1 else f"all levels, the largest of {len(rounds)} rounds"
            print(f"peak RSS of {name} (sum of its processes' peaks, {scope}): {rss / 2**30:.2f} GiB")
    for name, runs in results.items():
        for run in runs:
            if run.server is not None:
                print(f"\n{name}, concurrency {run.max_concurrency}:\n{format_server_comparison(run)}")
    if args.output_file:
        payload = {
            "machine": machine_description(),
            "args": vars(args),
            "results": {name: [run.to_json() for run in runs] for name, runs in results.items()},
            "rounds": [
                {name: [run.to_json() for run in runs] for name, runs in results_of_round.items()}
                for results_of_round in rounds
            ],
        }
        with open(args.output_file, "w") as f:
            json.dump(payload, f, indent=1)
    if args.plot:
        plot_sweep(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
