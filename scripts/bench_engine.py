"""Engine throughput, in-process, on the embedded model: srt's scheduler against Hugging Face transformers
on the same weights, same run, same machine. Recorded results are listed in docs/benchmarks/README.md.

Prints batch-1 decode tok/s, aggregate decode tok/s at 16 and 64 concurrent sequences, and prefill tok/s for
a 512-token prompt, for both, with the ratios.

    .venv/bin/python scripts/bench_engine.py [--model-path DIR_OR_GGUF] [--decode-tokens 64]

With `--device cuda` (bf16): decode at 1, 64 and 256 sequences and an 8,000-token prefill, for srt with the
Triton backend and decode CUDA graphs, Triton without graphs, and torch_native, against transformers'
`generate` on the same GPU (its decode rate: the time of n tokens less the time of 1, over n - 1 steps).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
from transformers import AutoConfig

from srt.heap import CHILD_MALLOC_ENV
from srt.io_struct import TokenizedGenerateReqInput
from srt.model_executor.model_runner import ModelRunner
from srt.model_source import resolve_model_dir
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs

PREFILL_LEN = 512
DECODE_PROMPT_LEN = 32
BATCHES = (1, 16, 64)
GPU_PREFILL_LEN = 8000  # "8k": within SmolLM2's 8,192-token context
GPU_BATCHES = (1, 64, 256)
HF_REPEATS = 2  # best of, for each of generate's two timings
# srt columns on a GPU: (name, ModelRunner arguments)
GPU_CONFIGS = (
    ("triton+graph", dict(attention_backend="triton", cuda_graph_max_bs=max(GPU_BATCHES))),
    ("triton eager", dict(attention_backend="triton", cuda_graph_max_bs=0)),
    ("torch_native", dict(attention_backend="torch_native", cuda_graph_max_bs=0)),
)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def srt_decode_rate(sched: Scheduler, prompts: list[list[int]], new_tokens: int) -> float:
    """Aggregate decode tokens/s: time only the decode steps once every sequence has been prefilled."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(TokenizedGenerateReqInput(rid=f"d{i}", input_ids=p, sampling_params=params))
    while sched.waiting or sched.chunked_req:
        sched.step()
    decoded, start = 0, time.perf_counter()
    while sched.running:
        decoded += len(sched.running)
        sched.step()
    rate = decoded / (time.perf_counter() - start)
    sched.flush_cache()
    return rate


def srt_prefill_rate(sched: Scheduler, prompt: list[int], repeats: int = 3) -> float:
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for r in range(repeats):
        sched.add_request(TokenizedGenerateReqInput(rid=f"p{r}", input_ids=prompt, sampling_params=params))
        start = time.perf_counter()
        sched.step()
        best = min(best, time.perf_counter() - start)
        sched.flush_cache()
    return len(prompt) / best


@torch.inference_mode()
def hf_decode_rate(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Same-length prompts, hand-written greedy loop over HF's DynamicCache: decode steps only."""
    from transformers import DynamicCache

    ids = torch.tensor(prompts)
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return len(prompts) * (new_tokens - 1) / (time.perf_counter() - start)


@torch.inference_mode()
def hf_prefill_rate(model, prompt: list[int], repeats: int = 3) -> float:
    ids = torch.tensor([prompt])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        best = min(best, time.perf_counter() - start)
    return len(prompt) / best


def timed(fn) -> float:
    """Seconds of `fn()`, with the GPU's queued work finished before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


@torch.inference_mode()
def hf_generate_decode_rate(model, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers' `generate` (greedy, same-length prompts): decode steps only, as the time of `new_tokens`
    tokens less the time of one."""
    ids = torch.tensor(prompts, device=model.device)

    def run(n: int) -> None:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False)  # fmt: skip

    run(2)  # warm-up
    one = min(timed(lambda: run(1)) for _ in range(HF_REPEATS))
    full = min(timed(lambda: run(new_tokens)) for _ in range(HF_REPEATS))
    return len(prompts) * (new_tokens - 1) / (full - one)


@torch.inference_mode()
def hf_gpu_prefill_rate(model, prompt: list[int], repeats: int = 3) -> float:
    ids = torch.tensor([prompt], device=model.device)
    model(input_ids=ids[:, :64], use_cache=False, logits_to_keep=1)  # warm-up
    best = min(timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)) for _ in range(repeats))
    return len(prompt) / best


def gpu_main(args, model_dir: str, vocab: int, rng: random.Random) -> None:
    """srt's GPU configurations against transformers' generate, bf16, on one GPU."""
    from transformers import AutoModelForCausalLM

    prefill_prompt = random_prompt(rng, GPU_PREFILL_LEN, vocab)
    decode_prompts = {
        b: [random_prompt(rng, DECODE_PROMPT_LEN, vocab) for _ in range(b)] for b in GPU_BATCHES
    }
    max_bs = max(GPU_BATCHES)
    server_args = ServerArgs(
        model_path=args.model_path, device=args.device, dtype="bfloat16", chunked_prefill_size=-1,
        max_prefill_tokens=GPU_PREFILL_LEN, max_running_requests=max_bs,
        max_total_tokens=max_bs * (DECODE_PROMPT_LEN + args.decode_tokens) + GPU_PREFILL_LEN + 1024,
    )  # fmt: skip
    names = [f"srt {name}" for name, _ in GPU_CONFIGS] + ["transformers"]
    rows: dict[str, list[float]] = {f"prefill {GPU_PREFILL_LEN} (tok/s)": []}
    rows.update({f"decode bs={b} (tok/s)": [] for b in GPU_BATCHES})
    for _, kwargs in GPU_CONFIGS:
        runner = ModelRunner(
            model_dir, device=args.device, dtype="bfloat16", max_total_tokens=server_args.max_total_tokens,
            max_running_requests=max_bs, **kwargs,
        )  # fmt: skip
        sched = Scheduler(server_args, runner)
        srt_prefill_rate(sched, prefill_prompt[:64], repeats=1)  # warm-up (Triton compiles its kernels)
        srt_decode_rate(sched, decode_prompts[1], 4)
        rows[f"prefill {GPU_PREFILL_LEN} (tok/s)"].append(srt_prefill_rate(sched, prefill_prompt))
        for b in GPU_BATCHES:
            rows[f"decode bs={b} (tok/s)"].append(
                srt_decode_rate(sched, decode_prompts[b], args.decode_tokens)
            )
        del sched, runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
    rows[f"prefill {GPU_PREFILL_LEN} (tok/s)"].append(hf_gpu_prefill_rate(model, prefill_prompt))
    for b in GPU_BATCHES:
        rows[f"decode bs={b} (tok/s)"].append(
            hf_generate_decode_rate(model, decode_prompts[b], args.decode_tokens)
        )
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"\n{device_name}, bf16, decode tokens per sequence: {args.decode_tokens}")
    print(
        f"{'figure':<24}"
        + "".join(f"{c:>20}" for c in names)
        + "".join(f"{c[4:] + ' / hf':>20}" for c in names[:-1])
    )
    for name, vals in rows.items():
        hf = vals[-1]
        print(
            f"{name:<24}"
            + "".join(f"{v:>20.1f}" for v in vals)
            + "".join(f"{v / hf:>20.2f}" for v in vals[:-1])
        )


def main() -> None:
    if any(os.environ.get(k) != v for k, v in CHILD_MALLOC_ENV.items()):
        # Measure the engine as the server runs it: the scheduler process keeps freed memory in its heap.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **CHILD_MALLOC_ENV})
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the GPU table (bf16)")
    ap.add_argument(
        "--quantization",
        nargs="+",
        default=["none", "w8a8_int8"],
        choices=["none", "w8a8_int8"],
        help="srt columns to measure",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    model_dir = resolve_model_dir(args.model_path)
    server_args = ServerArgs(
        model_path=args.model_path,
        max_total_tokens=64 * (DECODE_PROMPT_LEN + args.decode_tokens) + 1024,
        max_running_requests=64,
        chunked_prefill_size=-1,
    )
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    if args.device == "cuda":
        gpu_main(args, model_dir, vocab, rng)
        return
    prefill_prompt = random_prompt(rng, PREFILL_LEN, vocab)
    decode_prompts = {b: [random_prompt(rng, DECODE_PROMPT_LEN, vocab) for _ in range(b)] for b in BATCHES}

    columns = [f"srt {q}" for q in args.quantization]
    rows: dict[str, list[float]] = {"prefill 512 (tok/s)": []}
    rows.update({f"decode bs={b} (tok/s)": [] for b in BATCHES})
    for quantization in args.quantization:
        runner = ModelRunner(
            model_dir,
            max_total_tokens=server_args.max_total_tokens,
            max_running_requests=64,
            quantization=quantization,
        )
        sched = Scheduler(server_args, runner)
        srt_prefill_rate(sched, prefill_prompt[:64], repeats=1)  # warm-up
        rows["prefill 512 (tok/s)"].append(srt_prefill_rate(sched, prefill_prompt))
        for b in BATCHES:
            rows[f"decode bs={b} (tok/s)"].append(
                srt_decode_rate(sched, decode_prompts[b], args.decode_tokens)
            )
        del sched, runner

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        rows["prefill 512 (tok/s)"].append(hf_prefill_rate(model, prefill_prompt))
        for b in BATCHES:
            rows[f"decode bs={b} (tok/s)"].append(
                hf_decode_rate(model, decode_prompts[b], args.decode_tokens)
            )

    n = len(columns)
    header = "".join(f"{c:>18}" for c in columns)
    ratios = "".join(f"{c + ' / hf':>22}" for c in columns) if not args.skip_hf else ""
    print(f"\n{'figure':<24}{header}{'' if args.skip_hf else f'{chr(32) * 4}transformers'}{ratios}")
    for name, vals in rows.items():
        line = f"{name:<24}" + "".join(f"{v:>18.1f}" for v in vals[:n])
        if len(vals) > n:
            line += f"{vals[n]:>16.1f}" + "".join(f"{v / vals[n]:>22.2f}" for v in vals[:n])
        print(line)
    print(f"(torch threads: {torch.get_num_threads()}, decode tokens per sequence: {args.decode_tokens})")


if __name__ == "__main__":
    main()
