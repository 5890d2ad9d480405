"""Where a batch-1 scheduler step's time goes: the model's forward, and everything around it (drafting,
building the batch, verifying or sampling, appending, freeing, reporting), with and without speculation.

    .venv/bin/python scripts/bench_scheduler_step.py [--prompts 16] [--max-tokens 256] [--rounds 2]

Drives `Scheduler.step` in-process on the embedded int8 SmolLM2 over the first `--prompts` grounded prompts
of the speculative benchmark's workload, one request at a time, greedy, on a scheduler without speculation
and one with `--speculative-algorithm NGRAM` over the same runner: each prompt runs on both in turn (paired,
so the machine's drift reaches both alike), each from an empty cache, `--rounds` times. Per configuration it
prints the decode steps' median and mean forward time, the median and mean time outside it, and output
tokens per second of stepping, then NGRAM's ratio. The time outside the forward is what speculation must not
add back: a verify step's tokens are cheaper only while its bookkeeping stays small beside the forward.
Prefill steps are left out; no HTTP or detokenizer process either (scripts/bench_spec.py measures the
server).
"""

from __future__ import annotations

import argparse
import statistics
import time

from srt.io_struct import TokenizedGenerateReqInput
from srt.model_executor.model_runner import ModelRunner
from srt.model_source import resolve_model_dir
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs
from srt_bench.dataset import load_tokenizer
from srt_bench.grounded import load_records

WORKLOAD = "scripts/data/grounded_prompts.jsonl"
KV_TOKENS = 8192
CONFIGS = (("srt", None), ("srt-ngram", "NGRAM"))


def prompts(n: int) -> list[list[int]]:
    tokenizer = load_tokenizer(None)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for r in load_records(WORKLOAD)[:n]
    ]


def run_prompt(
    sched: Scheduler, runner: ModelRunner, rid: str, prompt: list[int], max_tokens: int, out: dict
):
    """One request alone through `sched`, then its cache flushed (so the other configuration starts from the
    same empty pool): adds its decode steps' (forward, outside) seconds, tokens and stepping seconds."""
    forward, original = [], runner.forward

    def timed(batch):
        t = time.perf_counter()
        result = original(batch)
        forward.append(time.perf_counter() - t)
        return result

    runner.forward = timed
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
        sched.handle(TokenizedGenerateReqInput(rid=rid, input_ids=prompt, sampling_params=params))
        first, produced = True, 0
        while not sched.is_idle:
            forward.clear()
            t = time.perf_counter()
            reply = sched.step()
            took = time.perf_counter() - t
            out["seconds"] += took
            if reply is not None and reply.completion_tokens:
                produced = max(produced, *reply.completion_tokens)
            if first:  # the prefill
                first = False
                continue
            if forward:
                out["steps"].append((sum(forward), took - sum(forward)))
        out["tokens"] += produced
    finally:
        runner.forward = original
    if not sched.flush_cache():
        raise RuntimeError("the scheduler is not idle after its request finished")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    model_dir = resolve_model_dir(None)
    runner = ModelRunner(
        model_dir, max_total_tokens=KV_TOKENS, max_running_requests=16, quantization="w8a8_int8"
    )
    ids = prompts(a.prompts)
    schedulers = {
        name: Scheduler(ServerArgs(model_path=model_dir, speculative_algorithm=algorithm), runner)
        for name, algorithm in CONFIGS
    }
    print(
        "| round | configuration | decode steps | forward median / mean ms | outside median / mean us | tok/s |"
    )
    print("|---|---|---|---|---|---|")
    for r in range(a.rounds):
        figures = {name: {"steps": [], "tokens": 0, "seconds": 0.0} for name in schedulers}
        for i, prompt in enumerate(ids):  # paired: each prompt on every configuration in turn
            for name, sched in schedulers.items():
                run_prompt(sched, runner, f"r{r}-p{i}", prompt, a.max_tokens, figures[name])
        for name, f in figures.items():
            fwd, out = [s[0] for s in f["steps"]], [s[1] for s in f["steps"]]
            print(
                f"| {r + 1} | {name} | {len(fwd)} | {statistics.median(fwd) * 1e3:.2f} / "
                f"{statistics.mean(fwd) * 1e3:.2f} | {statistics.median(out) * 1e6:.0f} / "
                f"{statistics.mean(out) * 1e6:.0f} | {f['tokens'] / f['seconds']:.1f} |"
            )
        base = figures[CONFIGS[0][0]]
        for name, f in list(figures.items())[1:]:
            ratio = (f["tokens"] / f["seconds"]) / (base["tokens"] / base["seconds"])
            print(f"| {r + 1} | {name} ÷ {CONFIGS[0][0]} | | | | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
