"""Load generator for any OpenAI-compatible server (srt, SGLang, vLLM, llama.cpp, transformers serve).

Examples:
    python scripts/bench_serving.py --backend srt --num-prompts 64 --max-concurrency 16
    python scripts/bench_serving.py --backend openai --endpoint completions --fixed-output min_tokens \\
        --base-url http://127.0.0.1:8080 --max-concurrency 1,16,64 --plot /tmp/bench --output-file run.json

Prompts come from the `random` dataset, built offline from the model's tokenizer. A comma-separated
--max-concurrency is a sweep: every level gets fresh prompts (no prefix-cache hits from an earlier level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys

from srt_bench.backends import BACKENDS, ENDPOINTS, FIXED_OUTPUT_MODES, Target
from srt_bench.dataset import load_tokenizer, random_requests
from srt_bench.plot import plot_cdfs, plot_sweep
from srt_bench.report import format_server_comparison, format_summary, format_sweep
from srt_bench.runner import RunResult, run_benchmark, warmup

logger = logging.getLogger("bench_serving")

DEFAULT_BASE_URL = "http://127.0.0.1:30000"


def parse_concurrency(text: str | None) -> list[int | None]:
    """`None` -> one unlimited run; `"1,16,64"` -> a sweep."""
    if text is None:
        return [None]
    levels = [int(part) for part in text.split(",") if part.strip()]
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError(f"--max-concurrency wants positive integers, got {text!r}")
    return levels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument("--backend", choices=BACKENDS, default="srt", help="srt: native /generate; openai: /v1/*")
    p.add_argument(
        "--endpoint", choices=ENDPOINTS, default="chat", help="OpenAI endpoint for --backend openai"
    )
    p.add_argument("--model", default=None, help="the `model` field; omitted when unset")
    p.add_argument(
        "--fixed-output",
        choices=FIXED_OUTPUT_MODES,
        default="ignore_eos",
        help="how to make the server generate exactly the asked length: ignore_eos (srt/SGLang/vLLM), "
        "min_tokens (llama.cpp), generation_config (transformers serve), none",
    )
    p.add_argument("--extra-request-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir; default: the embedded model's")
    p.add_argument("--dataset-name", choices=("random",), default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths uniform in [len*ratio, len]; 1 = fixed"
    )
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate (req/s); inf")
    p.add_argument("--max-concurrency", type=parse_concurrency, default=[None], help="N, or N1,N2,... sweep")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-file", default=None, help="JSON with the summary and every request's timings")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts into DIR")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


async def run_all(args: argparse.Namespace) -> list[RunResult]:
    target = Target(
        base_url=args.base_url,
        backend=args.backend,
        endpoint=args.endpoint,
        model=args.model,
        fixed_output=args.fixed_output,
        extra_body=json.loads(args.extra_request_body),
        api_key=args.api_key,
    )
    tokenizer = load_tokenizer(args.tokenizer)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    levels = args.max_concurrency
    dataset = random_requests(
        tokenizer,
        args.warmup_requests + args.num_prompts * len(levels),
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.seed,
        chat=target.chat,
    )
    warm, dataset = dataset[: args.warmup_requests], dataset[args.warmup_requests :]
    for req in warm:
        result = await warmup(target, req, count_tokens)
        if not result.success:
            raise SystemExit(f"warm-up request failed: {result.error}")
    runs = []
    for i, level in enumerate(levels):
        requests = dataset[i * args.num_prompts : (i + 1) * args.num_prompts]
        run = await run_benchmark(
            target, requests, count_tokens, args.request_rate, level, args.seed, not args.disable_tqdm
        )
        print(format_summary(run, args.backend))
        print(format_server_comparison(run))
        runs.append(run)
    return runs


def json_safe_args(args: argparse.Namespace) -> dict:
    """The command line as JSON (strict JSON has no Infinity: an unlimited rate is written as null)."""
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    runs = asyncio.run(run_all(args))
    if len(runs) > 1:
        print(format_sweep(runs))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"args": json_safe_args(args), "runs": [r.to_json() for r in runs]}, f, indent=1)
        logger.info("wrote %s", args.output_file)
    if args.plot:
        paths = plot_cdfs(runs, args.plot)
        if len(runs) > 1:
            paths += plot_sweep({args.backend: runs}, args.plot)
        logger.info("wrote %s", ", ".join(paths))
    return 0 if all(run.summary.completed for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
