"""Mixed prefill/decode steps on a burst workload: ITL, TTFT and throughput with and without
`--enable-mixed-chunk`, in-process (one model, one scheduler per mode, no HTTP).

    .venv/bin/python scripts/bench_mixed_chunk.py [--initial 8] [--bursts 3] [--burst-size 8] [--interval 2]

`--initial` requests arrive at once; then `--bursts` bursts of `--burst-size` requests, `--interval` seconds
apart (wall clock, so both modes see the same arrival times). Every request has a random `--input-len`-token
prompt and decodes `--output-len` tokens greedily (ignore_eos). ITL is the gap between consecutive tokens of
one request (the stall a running stream sees when a prompt is prefilled), TTFT is from arrival to the first
token. `--quantization none` benches fp32 (default: int8, the CPU default).
"""

from __future__ import annotations

import argparse
import random
import time

from srt.io_struct import TokenizedGenerateReqInput
from srt.model_executor.model_runner import ModelRunner
from srt.model_source import resolve_model_dir
from srt.sampling.sampling_params import SamplingParams
from srt.scheduler.scheduler import Scheduler
from srt.server_args import QUANTIZATIONS, ServerArgs

SEED = 0
TOKEN_RANGE = (100, 40000)  # ordinary tokens of SmolLM2's vocabulary
POLL_SECONDS = 0.005  # idle wait between arrivals


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def workload(args) -> list[tuple[float, TokenizedGenerateReqInput]]:
    rng = random.Random(SEED)
    times = [0.0] * args.initial
    for burst in range(1, args.bursts + 1):
        times += [burst * args.interval] * args.burst_size
    params = dict(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    return [
        (
            at,
            TokenizedGenerateReqInput(
                rid=f"r{i}",
                input_ids=[rng.randrange(*TOKEN_RANGE) for _ in range(args.input_len)],
                sampling_params=SamplingParams(**params),
                stream=True,
            ),
        )
        for i, at in enumerate(times)
    ]


def run(runner: ModelRunner, mixed: bool, args) -> dict:
    # explicit both ways: unset, the CPU default would mix
    modes = dict(enable_mixed_chunk=mixed, disable_mixed_chunk=not mixed)
    sched = Scheduler(ServerArgs(**modes, max_running_requests=64), runner)
    pending = workload(args)
    arrival: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    outputs = 0
    steps = mixed_steps = 0
    start = time.monotonic()
    while pending or not sched.is_idle:
        now = time.monotonic()
        while pending and start + pending[0][0] <= now:
            _, recv = pending.pop(0)
            arrival[recv.rid] = now
            sched.add_request(recv)
        if sched.is_idle:
            time.sleep(POLL_SECONDS)
            continue
        out = sched.step()
        steps += 1
        mixed_steps += sched.last_step_was_mixed
        if out is not None:
            for rid, ts in zip(out.rids, out.token_ts, strict=True):
                stamps.setdefault(rid, []).extend(ts)
                outputs += len(ts)
    makespan = time.monotonic() - start
    sched.flush_cache()
    itl = [b - a for ts in stamps.values() for a, b in zip(ts, ts[1:], strict=False)]
    ttft = [ts[0] - arrival[rid] for rid, ts in stamps.items()]
    return {
        "mode": "mixed" if mixed else "unmixed",
        "steps": steps,
        "mixed_steps": mixed_steps,
        "output_tok_s": outputs / makespan,
        "makespan_s": makespan,
        "itl_p50_ms": percentile(itl, 0.5) * 1e3,
        "itl_p99_ms": percentile(itl, 0.99) * 1e3,
        "itl_max_ms": max(itl) * 1e3,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--initial", type=int, default=8)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--burst-size", type=int, default=8)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--modes", default="unmixed,mixed")
    ap.add_argument("--quantization", default="w8a8_int8", choices=QUANTIZATIONS, help="default: the CPU's")
    args = ap.parse_args()
    runner = ModelRunner(
        resolve_model_dir(None),
        max_total_tokens=args.max_total_tokens,
        max_running_requests=64,
        quantization=args.quantization,
    )
    warm = argparse.Namespace(**{**vars(args), "initial": 2, "bursts": 0, "output_len": 4})
    run(runner, False, warm)
    print(
        f"{args.initial} requests, then {args.bursts} bursts of {args.burst_size} every {args.interval} s; "
        f"input {args.input_len}, output {args.output_len}"
    )
    for mode in args.modes.split(","):
        r = run(runner, mode == "mixed", args)
        print(
            f"{r['mode']:>8}: {r['output_tok_s']:.1f} output tok/s, makespan {r['makespan_s']:.1f} s, "
            f"ITL p50 {r['itl_p50_ms']:.0f} ms / p99 {r['itl_p99_ms']:.0f} ms / max {r['itl_max_ms']:.0f} ms, "
            f"TTFT p50 {r['ttft_p50_s']:.2f} s / p99 {r['ttft_p99_s']:.2f} s, "
            f"{r['steps']} steps ({r['mixed_steps']} mixed)"
        )


if __name__ == "__main__":
    main()
