"""The int8 quality gate: teacher-forced perplexity and top-1 agreement of srt's w8a8_int8 model against its
fp32 model — and of llama.cpp on the same GGUF, when llama-cpp-python is installed — on
`scripts/data/eval_text.txt` (written for this project: prose, code, lists, tables, dialogue, letters).

The text is split into windows of `--window` tokens, each evaluated as a fresh sequence; every model sees the
same token ids (the model's own tokenizer). Perplexity is exp(mean negative log-likelihood of each next
token); top-1 agreement is the share of positions where the model's most likely next token equals fp32's.

The gate: int8 may be the CPU default only if its perplexity is within 2 % of fp32, no worse than
llama.cpp's, and its top-1 agreement is at least 90 % (docs/cpu_execution.md, "The quality gate"). For a
GGUF, srt also runs the file's own blocks (`--quantization gguf`) and int8 weights made from them at load
(`gguf_int8`; which is a GGUF's CPU default depends on its size): each one's perplexity must be no more
than 0.5 % above llama.cpp's on the same file (both compute with the same
blocks and quantize activations per block; lower is no failure: on Gemma 3 270M srt's blocks came within
0.12 % of the dequantized fp32 weights' perplexity and llama.cpp 0.9 % above it).

    .venv/bin/python scripts/eval_quality.py [--model-path DIR|GGUF|NAME] [--window 1024] [--json out.json]
    .venv/bin/python scripts/eval_quality.py --random-lora-rank 16     # the gate through a LoRA adapter

With a LoRA adapter (`--lora-path`, or a random one of `--random-lora-rank` made by PEFT) both srt models run
through it (the int8 base with its fp32 adapter products against the fp32 base with the same adapter), and
llama.cpp is left out.

NAME is an embedded model (srt/model_source.py: smollm2-135m-instruct, the default, or gemma3-270m).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TEXT = os.path.join(HERE, "data", "eval_text.txt")
MAX_PPL_INCREASE = 0.02
ADAPTER_NAME = "eval"  # the --lora-path adapter's name in the runners
# --random-lora-rank's weights: the spread the SmolLM2 tests use, which moves its outputs substantially
RANDOM_LORA_STD = 0.02
MIN_TOP1_AGREEMENT = 0.90
# srt on a GGUF's blocks, and on int8 made from them, against llama.cpp on the same file
MAX_GGUF_PPL_GAP = 0.005
GGUF_METHODS = {"gguf": "srt gguf (blocks)", "gguf_int8": "srt gguf_int8"}


def score(windows) -> tuple[float, torch.Tensor, int]:
    """(perplexity, top-1 prediction at every scored position, positions) over (logits, ids) windows."""
    nll, count, tops = 0.0, 0, []
    for logits, ids in windows:
        logits = torch.as_tensor(logits, dtype=torch.float32)[:-1]
        targets = ids[1:]
        logprobs = torch.log_softmax(logits, dim=-1)
        nll -= logprobs.gather(1, targets.unsqueeze(1)).sum().item()
        count += len(targets)
        tops.append(logits.argmax(dim=-1))
    return math.exp(nll / count), torch.cat(tops), count


def srt_windows(
    model_dir: str,
    ids: list[int],
    window: int,
    quantization: str,
    kv_cache_dtype: str = "auto",
    adapter: str | None = None,
):
    """srt's logits over the windows; with `adapter` (a PEFT directory), through that LoRA adapter."""
    from srt.lora.adapter import adapter_rank
    from srt.lora.manager import LoRAConfig
    from srt.model_executor.model_runner import ModelRunner

    lora = (
        None
        if adapter is None
        else LoRAConfig(max_loras_per_batch=1, max_lora_rank=adapter_rank(adapter) or 1)
    )
    runner = ModelRunner(
        model_dir,
        max_total_tokens=window + 16,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        lora=lora,
    )
    if adapter is not None:
        runner.lora.load(ADAPTER_NAME, adapter)
    return list(runner.forward_windows(ids, window, ADAPTER_NAME if adapter is not None else None))


def llama_cpp_windows(gguf: str, ids: list[int], window: int, threads: int):
    """llama.cpp's logits for the same windows, or None when llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=gguf, n_ctx=window, logits_all=True, n_threads=threads, verbose=False)
    out = []
    for start in range(0, len(ids), window):
        chunk = ids[start : start + window]
        llm.reset()
        llm.eval(chunk)
        out.append((torch.from_numpy(llm.scores[: len(chunk)].copy()), torch.tensor(chunk)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model-path", default=None, help="a directory, GGUF or embedded model name; default: SmolLM2"
    )
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when installed")
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="the int8 model's, as the server's flag (fp32 stays fp32)"
    )
    p.add_argument(
        "--lora-path",
        default=None,
        help="a LoRA adapter (PEFT directory): both srt models run through it; llama.cpp is skipped",
    )
    p.add_argument(
        "--random-lora-rank",
        type=int,
        default=None,
        help="make a random adapter of this rank on every module with PEFT and gate through it",
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from srt.model_source import embedded_gguf_path, embedded_model_name, resolve_model_dir

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model_path)
    embedded = embedded_model_name(args.model_path)
    gguf = args.model_path if args.model_path and args.model_path.endswith(".gguf") else None
    if embedded is not None:
        gguf = embedded_gguf_path(embedded)
    with open(args.text, encoding="utf-8") as f:
        ids = AutoTokenizer.from_pretrained(model_dir)(f.read())["input_ids"]
    print(f"evaluation text: {args.text} ({len(ids)} tokens, windows of {args.window})", flush=True)

    adapter = args.lora_path
    if args.random_lora_rank is not None:
        from srt_bench.lora_adapters import random_peft_adapter

        adapter = random_peft_adapter(
            model_dir,
            tempfile.mkdtemp(prefix="eval_lora_"),
            args.random_lora_rank,
            seed=0,
            std=RANDOM_LORA_STD,
        )
    if adapter is not None:
        print(f"through the LoRA adapter {adapter}", flush=True)
    results = {}
    t0 = time.monotonic()
    ppl_fp32, top_fp32, n = score(srt_windows(model_dir, ids, args.window, "none", adapter=adapter))
    results["srt fp32"] = {"perplexity": ppl_fp32, "top1_agreement": 1.0, "seconds": time.monotonic() - t0}
    t0 = time.monotonic()
    ppl, top, _ = score(srt_windows(model_dir, ids, args.window, "w8a8_int8", args.kv_cache_dtype, adapter))
    results["srt w8a8_int8"] = {
        "perplexity": ppl,
        "top1_agreement": (top == top_fp32).float().mean().item(),
        "seconds": time.monotonic() - t0,
    }
    for method in GGUF_METHODS if gguf is not None and adapter is None else ():
        t0 = time.monotonic()
        ppl_g, top_g, _ = score(srt_windows(gguf, ids, args.window, method))
        results[GGUF_METHODS[method]] = {
            "perplexity": ppl_g,
            "top1_agreement": (top_g == top_fp32).float().mean().item(),
            "seconds": time.monotonic() - t0,
        }
    t0 = time.monotonic()
    llama = (
        None
        if args.no_llama_cpp or gguf is None or adapter is not None
        else llama_cpp_windows(gguf, ids, args.window, args.threads)
    )
    if llama is not None:
        ppl_l, top_l, _ = score(llama)
        results["llama.cpp (GGUF)"] = {
            "perplexity": ppl_l,
            "top1_agreement": (top_l == top_fp32).float().mean().item(),
            "seconds": time.monotonic() - t0,
        }

    print(f"\n{'model':<20}{'perplexity':>12}{'vs fp32':>10}{'top-1 = fp32':>14}")
    for name, r in results.items():
        delta = (r["perplexity"] / ppl_fp32 - 1) * 100
        print(f"{name:<20}{r['perplexity']:>12.3f}{delta:>+9.2f}%{r['top1_agreement'] * 100:>13.1f}%")
    int8 = results["srt w8a8_int8"]
    checks = {
        "perplexity within 2 % of fp32": int8["perplexity"] <= ppl_fp32 * (1 + MAX_PPL_INCREASE),
        "top-1 agreement >= 90 %": int8["top1_agreement"] >= MIN_TOP1_AGREEMENT,
    }
    if llama is not None:
        checks["perplexity no worse than llama.cpp's"] = (
            int8["perplexity"] <= results["llama.cpp (GGUF)"]["perplexity"]
        )
        for method, name in GGUF_METHODS.items():
            if name in results:
                gap = results[name]["perplexity"] / results["llama.cpp (GGUF)"]["perplexity"] - 1
                checks[f"{method}'s perplexity at most 0.5 % above llama.cpp's ({gap * 100:+.2f} %)"] = (
                    gap <= MAX_GGUF_PPL_GAP
                )
    elif adapter is not None:
        print("\n(through a LoRA adapter: llama.cpp is not compared)")
    else:
        print("\n(llama-cpp-python is not installed: the comparison with llama.cpp is skipped)")
    print()
    for what, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {what}")
    passed = all(checks.values()) and (llama is not None or adapter is not None)
    print(
        f"\ngate: {'PASS' if passed else 'FAIL' if not all(checks.values()) else 'INCOMPLETE (no llama.cpp)'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "tokens": len(ids),
                    "scored": n,
                    "window": args.window,
                    "results": results,
                    "checks": checks,
                },
                f,
                indent=2,
            )
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
