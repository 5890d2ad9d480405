"""Where a batch-1 scheduler step's time goes: the model's forward, and everything around it (drafting,
building the batch, verifying or sampling, appending, freeing, reporting), with and without speculation.

    .venv/bin/python scripts/bench_scheduler_step.py [--prompts 6] [--max-tokens 160] [--rounds 2]

Drives `Scheduler.step` in-process on the embedded int8 SmolLM2 over the first `--prompts` grounded prompts
of the speculative benchmark's workload, one request at a time, greedy, taking turns between a server without
speculation and one with `--speculative-algorithm NGRAM` (`--rounds` times each). Per configuration it prints
the decode steps' median and mean forward time, the median and mean time outside it, and output tokens per
second of stepping. The time outside the forward is what speculation must not add back: a verify step's
tokens are cheaper only while its bookkeeping stays small beside the forward. Prefill steps are left out.
"""

from __future__ import annotations

import argparse
import statistics
import time

from srt.bench.dataset import load_tokenizer
from srt.bench.grounded import load_records
from srt.io_struct import TokenizedGenerateReqInput
from srt.model_executor.model_runner import ModelRunner
from srt.model_source import resolve_model_dir
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler
from srt.server_args import ServerArgs

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


def run(runner: ModelRunner, model_dir: str, algorithm: str | None, ids: list[list[int]], max_tokens: int):
    """(forward seconds, outside seconds) per decode step, output tokens, seconds of stepping."""
    args = ServerArgs(model_path=model_dir, speculative_algorithm=algorithm)
    sched = Scheduler(args, runner)
    forward, original = [], runner.forward

    def timed(batch):
        t = time.perf_counter()
        out = original(batch)
        forward.append(time.perf_counter() - t)
        return out

    runner.forward = timed
    steps, tokens, seconds = [], 0, 0.0
    try:
        for i, prompt in enumerate(ids):
            params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
            sched.handle(TokenizedGenerateReqInput(rid=f"p{i}", input_ids=prompt, sampling_params=params))
            first, produced = True, 0
            while not sched.is_idle:
                forward.clear()
                t = time.perf_counter()
                out = sched.step()
                took = time.perf_counter() - t
                seconds += took
                if out is not None and out.completion_tokens:
                    produced = max(produced, *out.completion_tokens)
                if first:  # the prefill
                    first = False
                    continue
                if forward:
                    steps.append((sum(forward), took - sum(forward)))
            tokens += produced
    finally:
        runner.forward = original
    return steps, tokens, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    model_dir = resolve_model_dir(None)
    runner = ModelRunner(
        model_dir, max_total_tokens=KV_TOKENS, max_running_requests=16, quantization="w8a8_int8"
    )
    ids = prompts(a.prompts)
    print(
        "| round | configuration | decode steps | forward median / mean ms | outside median / mean us | tok/s |"
    )
    print("|---|---|---|---|---|---|")
    for r in range(a.rounds):
        for name, algorithm in CONFIGS:
            steps, tokens, seconds = run(runner, model_dir, algorithm, ids, a.max_tokens)
            fwd, out = [s[0] for s in steps], [s[1] for s in steps]
            print(
                f"| {r + 1} | {name} | {len(steps)} | {statistics.median(fwd) * 1e3:.2f} / "
                f"{statistics.mean(fwd) * 1e3:.2f} | {statistics.median(out) * 1e6:.0f} / "
                f"{statistics.mean(out) * 1e6:.0f} | {tokens / seconds:.1f} |"
            )


if __name__ == "__main__":
    main()
