"""Speculative decoding on srt: what n-gram drafts and Predicted Outputs buy, where they must not cost, and
whether greedy outputs stay exactly the same.

Starts one server per configuration, one after another, on the embedded SmolLM2:
- `srt`: no speculation (the reference of every ratio and of the output comparison);
- `srt-ngram`: `--speculative-algorithm NGRAM`;
- `srt-prediction`, `srt-ngram-prediction`: grounded requests carry OpenAI's `prediction` (their original
  text), on a server without and with NGRAM;
- `llama.cpp-lookup`: llama.cpp's server from llama-cpp-python with its prompt-lookup draft (skipped with a
  message when not installed, or when the installed version has no such draft).
Workloads: the grounded prompts (scripts/data/grounded_prompts.jsonl) and short open questions, one request
at a time, greedy, answers ending on their own under `--max-tokens`; bench_peers' random chat workload
(input 256 / output 64 tokens, fixed length) at concurrency 16 and 64. The table gives output tok/s, the ratio
to `srt`, the mean acceptance length from srt's `/metrics` (1 + accepted / drafts over the run) and how many
answers were identical to `srt`'s; a checklist of the targets follows. A benchmark, never part of the tests.

    python scripts/bench_spec.py                                       # everything, one round
    python scripts/bench_spec.py --peers srt,srt-ngram --num-prompts 12 --concurrency 16 --concurrency-prompts 32
    python scripts/bench_spec.py --rounds 3 --output-file spec.json
    python scripts/bench_spec.py --peers srt,srt-ngram,srt-prediction --paired --concurrency '' \
        --concurrency-prompts ''

`--paired` keeps every configuration's server up at once and sends each batch-1 prompt to each in turn: on a
shared machine whose speed drifts by tens of % within minutes, whole runs one after another measure the
drift as much as the servers; paired prompts meet it alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
from dataclasses import replace

from srt.model_source import DEFAULT_EMBEDDED_MODEL, embedded_gguf_path, resolve_model_dir
from srt_bench.dataset import load_tokenizer, random_requests
from srt_bench.grounded import (
    SpecFigures,
    grounded_requests,
    load_records,
    open_requests,
    run_one_by_one,
    run_paired,
)
from srt_bench.peers import llama_cpp_peer, machine_description, running_peer, srt_peer, wait_peer_ready
from srt_bench.runner import METRICS_SETTLE_S, new_session, run_benchmark, scrape_metrics, warmup
from srt_bench.spec_report import (
    BATCH_ONE,
    CONFIGS,
    GROUNDED,
    OPEN,
    REFERENCE,
    Measurement,
    results_table,
    targets_checklist,
)

logger = logging.getLogger("bench_spec")

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_WORKLOAD = os.path.join(HERE, "data", "grounded_prompts.jsonl")
BASE_PORT = 30200
NGRAM_FLAGS = ("--speculative-algorithm", "NGRAM")
# llama-cpp-python's own default for draft_model_num_pred_tokens.
LLAMA_LOOKUP_TOKENS = 10


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default=",".join(CONFIGS), help="comma-separated configurations, run in order")
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, help="grounded prompts, JSON lines")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="first N grounded prompts and open questions (default: all)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=256, help="cap on each batch-1 answer (not a fixed length)"
    )
    p.add_argument("--concurrency", default="16,64", help="levels of the random workload ('' skips it)")
    p.add_argument("--concurrency-prompts", default="32,64", help="requests per level, one number per level")
    p.add_argument("--input-len", type=int, default=256, help="random workload prompt tokens (bench_peers')")
    p.add_argument("--output-len", type=int, default=64, help="random workload output tokens, fixed")
    p.add_argument(
        "--num-draft-tokens", type=int, default=None, help="--speculative-num-draft-tokens for NGRAM"
    )
    p.add_argument("--ngram-min", type=int, default=None, help="--speculative-ngram-min-match-window-size")
    p.add_argument("--ngram-max", type=int, default=None, help="--speculative-ngram-max-match-window-size")
    p.add_argument("--lookup-tokens", type=int, default=LLAMA_LOOKUP_TOKENS, help="llama.cpp's drafts a step")
    p.add_argument(
        "--rounds", type=int, default=1, help="run every configuration this many times, taking turns"
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="start every configuration's server at once and send each batch-1 prompt to each in turn",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--base-port", type=int, default=BASE_PORT)
    p.add_argument("--log-dir", default=None, help="server logs; default: a temporary directory")
    p.add_argument("--output-file", default=None, help="JSON with every round's runs and counters")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def ngram_flags(args: argparse.Namespace) -> list[str]:
    flags = list(NGRAM_FLAGS)
    for flag, value in (
        ("--speculative-num-draft-tokens", args.num_draft_tokens),
        ("--speculative-ngram-min-match-window-size", args.ngram_min),
        ("--speculative-ngram-max-match-window-size", args.ngram_max),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def llama_lookup_missing() -> str | None:
    """Why the installed llama-cpp-python cannot draft by prompt lookup (None: it can, or it is not installed,
    which its peer already reports)."""
    try:
        from llama_cpp.server.settings import ModelSettings
    except ImportError:
        return None
    if "draft_model" not in ModelSettings.model_fields:
        return "this llama-cpp-python has no draft_model setting: skipping llama.cpp-lookup"
    return None


def make_peer(name: str, port: int, model_dir: str, args: argparse.Namespace):
    server = CONFIGS[name].server
    if server == "srt":
        return srt_peer(port, model_dir, name=name)
    if server == "srt-ngram":
        return srt_peer(port, model_dir, *ngram_flags(args), name=name)
    peer = llama_cpp_peer(port, embedded_gguf_path(DEFAULT_EMBEDDED_MODEL))
    lookup = [
        "--draft_model",
        "prompt-lookup-decoding",
        "--draft_model_num_pred_tokens",
        str(args.lookup_tokens),
    ]
    return replace(
        peer, name=name, command=peer.command + lookup, missing=peer.missing or llama_lookup_missing()
    )


async def scrape(base_url: str):
    async with new_session() as session:
        return await scrape_metrics(session, base_url)


def log_measurement(name: str, workload: str, m: Measurement) -> None:
    s, spec = m.run.summary, m.spec
    logger.info(
        "%s %s: %d ok, %d failed, %.1f output tok/s, accept length %s",
        name, workload, s.completed, s.failed, s.output_throughput,
        "-" if spec is None or spec.accept_length is None else f"{spec.accept_length:.2f}",
    )  # fmt: skip


async def measure_alone(name, peer, workload, level, requests, count_tokens, show_progress) -> Measurement:
    """One workload on one server while no other is measured: batch-1 ones one request at a time, answers
    ending on their own; the random ones at their concurrency."""
    before = await scrape(peer.target.base_url)
    if workload in BATCH_ONE:
        natural = replace(peer.target, fixed_output="none")  # grounded answers end on their own
        run = await run_one_by_one(natural, requests, count_tokens, CONFIGS[name].prediction)
    else:
        run = await run_benchmark(
            peer.target, requests, count_tokens, max_concurrency=level, show_progress=show_progress
        )
    await asyncio.sleep(METRICS_SETTLE_S)
    m = Measurement(run, SpecFigures.between(before, await scrape(peer.target.base_url)))
    log_measurement(name, workload, m)
    return m


async def start(name, peer, log_path, warm_request, count_tokens, stack: contextlib.ExitStack) -> None:
    """Start one server (stopped when `stack` closes) and warm it up."""
    server = stack.enter_context(running_peer(peer, log_path))
    logger.info("%s ready after %.1f s", name, await wait_peer_ready(server, peer, count_tokens))
    warm = await warmup(peer.target, warm_request, count_tokens)
    if not warm.success:
        raise RuntimeError(f"{name} warm-up failed: {warm.error}")


async def bench_config(
    name, peer, workloads, warm_request, count_tokens, log_path, show_progress, out
) -> None:
    """Start one server, warm it up, run its workloads into `out` (kept when interrupted), stop it."""
    with contextlib.ExitStack() as stack:
        await start(name, peer, log_path, warm_request, count_tokens, stack)
        for workload, (level, requests) in workloads.items():
            if CONFIGS[name].runs(workload):
                out[workload] = await measure_alone(
                    name, peer, workload, level, requests, count_tokens, show_progress
                )


async def bench_paired(
    peers, workloads, warm_request, count_tokens, log_paths, show_progress, results
) -> None:
    """Every configuration's server up at once (`peers`: name -> peer): each batch-1 workload paired prompt
    by prompt (`run_paired`), the random workloads one server at a time while the others idle."""
    with contextlib.ExitStack() as stack:
        for name, peer in peers.items():
            await start(name, peer, log_paths[name], warm_request, count_tokens, stack)
        for workload, (level, requests) in workloads.items():
            running = [name for name in peers if CONFIGS[name].runs(workload)]
            if workload not in BATCH_ONE:
                for name in running:
                    results.setdefault(name, {})[workload] = await measure_alone(
                        name, peers[name], workload, level, requests, count_tokens, show_progress
                    )
                continue
            targets = [replace(peers[name].target, fixed_output="none") for name in running]
            before = [await scrape(t.base_url) for t in targets]
            runs = await run_paired(targets, requests, count_tokens, [CONFIGS[n].prediction for n in running])
            await asyncio.sleep(METRICS_SETTLE_S)
            for name, target, run, snapshot in zip(running, targets, runs, before, strict=True):
                m = Measurement(run, SpecFigures.between(snapshot, await scrape(target.base_url)))
                log_measurement(name, workload, m)
                results.setdefault(name, {})[workload] = m


async def main_async(args: argparse.Namespace) -> list[dict[str, dict[str, Measurement]]]:
    levels, counts = _ints(args.concurrency), _ints(args.concurrency_prompts)
    if len(levels) != len(counts):
        raise SystemExit("--concurrency-prompts needs one count per --concurrency level")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    names = args.peers.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    if REFERENCE not in names:
        logger.warning("without %s there are no ratios and no output comparison", REFERENCE)
    model_dir = resolve_model_dir(None)
    tokenizer = load_tokenizer(model_dir)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    grounded = grounded_requests(load_records(args.workload), tokenizer, args.max_tokens)[: args.num_prompts]
    questions = open_requests(tokenizer, args.max_tokens)[: args.num_prompts]
    # one warm-up request first, then fresh prompts for every level (no prefix-cache hits across levels)
    random_set = random_requests(
        tokenizer, 1 + sum(counts), args.input_len, args.output_len, 1.0, args.seed, True
    )
    workloads = {GROUNDED: (1, grounded), OPEN: (1, questions)}
    offset = 1
    for level, count in zip(levels, counts, strict=True):
        workloads[f"random-c{level}"] = (level, random_set[offset : offset + count])
        offset += count
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_spec_")
    os.makedirs(log_dir, exist_ok=True)
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    rounds: list[dict[str, dict[str, Measurement]]] = []
    for r in range(args.rounds):
        results: dict[str, dict[str, Measurement]] = {}
        rounds.append(results)
        peers = {}  # the configurations that can run here, each on its own port
        for i, name in enumerate(names):
            peer = make_peer(name, args.base_port + i, model_dir, args)
            if peer.missing:
                if r == 0:
                    logger.warning("%s", peer.missing)
                continue
            peers[name] = peer
        log_paths = {name: os.path.join(log_dir, f"{name}-round{r + 1}.log") for name in peers}
        if args.paired:
            try:
                await bench_paired(
                    peers, workloads, random_set[0], count_tokens, log_paths, not args.disable_tqdm, results
                )
            except (RuntimeError, TimeoutError) as exc:
                logger.error("round %d could not be benchmarked: %s", r + 1, exc)
            except asyncio.CancelledError:
                logger.warning("interrupted: reporting what was measured so far")
                return rounds
            continue
        for name, peer in peers.items():
            try:
                await bench_config(
                    name, peer, workloads, random_set[0], count_tokens, log_paths[name], not args.disable_tqdm,
                    results.setdefault(name, {}),
                )  # fmt: skip
            except (RuntimeError, TimeoutError) as exc:
                logger.error("%s could not be benchmarked: %s", name, exc)
            except asyncio.CancelledError:
                logger.warning("interrupted during %s: reporting what was measured so far", name)
                return rounds
    return rounds


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    rounds = [results for results in asyncio.run(main_async(args)) if results]
    if not rounds:
        logger.error("no configuration could be benchmarked")
        return 1
    print(f"\nMachine: {machine_description()}\nCommand: {command}")
    print(
        f"Model: {DEFAULT_EMBEDDED_MODEL}, greedy, chat endpoint. Batch 1: grounded prompts and open questions, "
        f"answers capped at {args.max_tokens} tokens; random: input {args.input_len} / output {args.output_len} "
        f"tokens, fixed length. Rounds: {len(rounds)}{', paired prompt by prompt' if args.paired else ''} (each "
        "cell is its workload's median round; each ratio the median of the rounds' ratios)\n"
    )
    print(results_table(rounds))
    print(f"\nTargets:\n{targets_checklist(rounds)}")
    if args.output_file:
        payload = {
            "machine": machine_description(),
            "command": command,
            "args": vars(args),
            "rounds": [
                {
                    name: {
                        w: {"run": m.run.to_json(), "spec": None if m.spec is None else vars(m.spec)}
                        for w, m in by_workload.items()
                    }
                    for name, by_workload in results.items()
                }
                for results in rounds
            ],
        }
        with open(args.output_file, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
