"""Times ModelRunner.forward alone (no scheduler, no sampling beyond argmax) on the embedded model.

Prints batch-1 decode tokens/s, aggregate decode tokens/s at several batch sizes, and prefill tokens/s of
one long prompt. Usage: python scripts/bench_model_forward.py [--model-path DIR_OR_GGUF] [--context 256]

`--verify-rows N` also times batch-1 verify steps of 1..N fed tokens (logits for every row) after `--context`
cached tokens, and prints them as `--step-ms` for scripts/spec_replay.py.
`--verify-table` times, at each batch size, verify steps of 2..17 fed tokens a sequence against a decode step
(on a GPU: `--device cuda --dtype bfloat16 --quantization none --cuda-graph-max-bs 64`, decode replayed).
`--mixed NEW ROWS` also times a mixed step: one sequence extends by NEW tokens after a `--mixed-prefix`
cached prefix while ROWS sequences of `--context` cached tokens decode one each (a concurrency-64 step is
about 130 and 36). `--kernel-times` adds the int8 model's C kernels' share of each step, kernel by kernel.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner
from srt.model_source import resolve_model_dir
from srt_bench.kernel_times import timed_with_kernels

logger = logging.getLogger("bench_model_forward")

TOKEN_ID = 1000  # any ordinary token; the content does not change the cost
WARMUP_STEPS = 2
BENCH_KV_TOKENS = 50_000  # enough for 64 sequences of 512 cached tokens plus the timed steps


def fill_sequences(runner: ModelRunner, bs: int, context: int) -> tuple[list[int], torch.Tensor]:
    """Allocate `bs` rows with `context` KV slots each (contents irrelevant for timing)."""
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool_allocator.clear()
    rows = runner.req_to_token_pool.alloc(bs)
    for row in rows:
        runner.req_to_token_pool.req_to_token[row, :context] = runner.token_to_kv_pool_allocator.alloc(
            context
        )
    return rows, torch.tensor(rows, dtype=torch.int64, device=runner.device)


def time_decode(runner: ModelRunner, bs: int, context: int, steps: int) -> float:
    """Seconds per decode step for `bs` sequences that each already hold `context` tokens."""
    rows, row_tensor = fill_sequences(runner, bs, context)
    table = runner.req_to_token_pool.req_to_token
    times = []
    for step in range(WARMUP_STEPS + steps):
        seq_len = context + step + 1
        slots = runner.token_to_kv_pool_allocator.alloc(bs)
        table[row_tensor, seq_len - 1] = slots
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=torch.full((bs,), TOKEN_ID, dtype=torch.int64, device=runner.device),
            positions=torch.full((bs,), seq_len - 1, dtype=torch.int64, device=runner.device),
            out_cache_loc=slots,
            req_pool_indices=row_tensor,
            seq_lens=torch.full((bs,), seq_len, dtype=torch.int64, device=runner.device),
            seq_lens_cpu=[seq_len] * bs,
        )
        start = time.perf_counter()
        runner.forward(batch).argmax(-1)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP_STEPS:])


def time_prefill(runner: ModelRunner, length: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        rows, row_tensor = fill_sequences(runner, 1, 0)
        slots = runner.token_to_kv_pool_allocator.alloc(length)
        runner.req_to_token_pool.req_to_token[rows[0], :length] = slots
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=torch.full((length,), TOKEN_ID, dtype=torch.int64, device=runner.device),
            positions=torch.arange(length, dtype=torch.int64, device=runner.device),
            out_cache_loc=slots,
            req_pool_indices=row_tensor,
            seq_lens=torch.tensor([length], device=runner.device),
            seq_lens_cpu=[length],
            extend_prefix_lens_cpu=[0],
            extend_seq_lens_cpu=[length],
        )
        start = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - start)
    return min(times)


def time_mixed(runner: ModelRunner, new: int, prefix: int, rows: int, context: int, steps: int) -> float:
    """Median seconds of a mixed step: `new` prompt tokens after `prefix` cached ones, plus `rows` decoding
    sequences of `context` cached tokens."""
    table, allocator = runner.req_to_token_pool.req_to_token, runner.token_to_kv_pool_allocator
    times = []
    for _ in range(WARMUP_STEPS + steps):
        runner.req_to_token_pool.clear()
        allocator.clear()
        seqs = runner.req_to_token_pool.alloc(rows + 1)
        table[seqs[0], : prefix + new] = allocator.alloc(prefix + new)
        for row in seqs[1:]:
            table[row, : context + 1] = allocator.alloc(context + 1)
        slots = torch.cat([table[seqs[0], prefix : prefix + new], table[seqs[1:], context]])
        batch = ForwardBatch(
            mode=ForwardMode.MIXED,
            batch_size=rows + 1,
            input_ids=torch.full((new + rows,), TOKEN_ID, dtype=torch.int64),
            positions=torch.cat([torch.arange(prefix, prefix + new), torch.full((rows,), context)]),
            out_cache_loc=slots,
            req_pool_indices=torch.tensor(seqs, dtype=torch.int64),
            seq_lens=torch.tensor([prefix + new] + [context + 1] * rows),
            seq_lens_cpu=[prefix + new] + [context + 1] * rows,
            extend_prefix_lens_cpu=[prefix] + [context] * rows,
            extend_seq_lens_cpu=[new] + [1] * rows,
            num_decode=rows,
        )
        start = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP_STEPS:])


def time_verify(
    runner: ModelRunner, rows: int, context: int, steps: int, bs: int = 1, as_decode_rows: bool = False
) -> float:
    """Median seconds of a verify step of `bs` sequences: `rows` fed tokens each (the newest and its drafts)
    after `context` cached ones, with logits for every row, as the scheduler's verify step asks: an extend
    step, or with `as_decode_rows` the decode-row layout a runner with decode graphs replays
    (`StepBuilder.verify_rows_as_decode`)."""
    table, allocator, device = (
        runner.req_to_token_pool.req_to_token,
        runner.token_to_kv_pool_allocator,
        runner.device,
    )
    seqs, seq_tensor = fill_sequences(runner, bs, context)
    positions = torch.arange(context, context + rows, dtype=torch.int64, device=device).repeat(bs)
    times = []
    for _ in range(WARMUP_STEPS + steps):
        slots = allocator.alloc(rows * bs)
        table[seq_tensor, context : context + rows] = slots.view(bs, rows)
        fed = dict(
            input_ids=torch.full((rows * bs,), TOKEN_ID, dtype=torch.int64, device=device),
            positions=positions,
            out_cache_loc=slots,
        )
        if as_decode_rows:
            batch = ForwardBatch(
                mode=ForwardMode.DECODE,
                batch_size=rows * bs,
                req_pool_indices=seq_tensor.repeat_interleave(rows),
                seq_lens=positions + 1,
                seq_lens_cpu=(positions + 1).tolist(),
                **fed,
            )
        else:
            batch = ForwardBatch(
                mode=ForwardMode.EXTEND,
                batch_size=bs,
                req_pool_indices=seq_tensor,
                seq_lens=torch.full((bs,), context + rows, dtype=torch.int64, device=device),
                seq_lens_cpu=[context + rows] * bs,
                extend_prefix_lens_cpu=[context] * bs,
                extend_seq_lens_cpu=[rows] * bs,
                logit_rows=torch.arange(rows * bs, dtype=torch.int64, device=device),
                **fed,
            )
        start = time.perf_counter()
        runner.forward(batch).argmax(-1)
        times.append(time.perf_counter() - start)
        allocator.free(slots)
    return statistics.median(times[WARMUP_STEPS:])


def time_hf_decode(model, bs: int, context: int, steps: int) -> float:
    """Seconds per decode step of transformers on the same weights (DynamicCache), same shapes."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.full((bs, context), TOKEN_ID), past_key_values=cache, use_cache=True)
        times = []
        for _ in range(WARMUP_STEPS + steps):
            start = time.perf_counter()
            model(torch.full((bs, 1), TOKEN_ID), past_key_values=cache, use_cache=True).logits[:, -1].argmax(
                -1
            )
            times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP_STEPS:])


def time_hf_prefill(model, length: int, repeats: int) -> float:
    with torch.inference_mode():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(torch.full((1, length), TOKEN_ID), use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - start)
    return min(times)


VERIFY_TABLE_ROWS = (2, 3, 5, 9, 17)  # fed tokens a sequence: the newest plus 1, 2, 4, 8, 16 drafts


def log_verify_table(runner: ModelRunner, args) -> None:
    """A verify step's cost against a decode step's at each batch size: where the ratio stays near 1, drafts
    are nearly free, which is what a device's verify budget (srt/speculative/defaults.py) is chosen from.
    Both layouts: as an extend step, and as decode rows (replayed from a graph when the runner has one)."""
    steps = max(args.steps, 15)
    for bs in args.batch_sizes:
        decode = time_decode(runner, bs, args.context, steps)
        for as_rows in (False, True):
            cells = []
            for rows in VERIFY_TABLE_ROWS:
                verify = time_verify(runner, rows, args.context, steps, bs, as_decode_rows=as_rows)
                cells.append(f"{rows * bs}:{verify * 1e3:.2f} ms ({verify / decode:.2f}x)")
            logger.info(
                "verify as %s, bs=%d, decode %.2f ms | fed tokens: %s",
                "decode rows" if as_rows else "extend",
                bs,
                decode * 1e3,
                " ".join(cells),
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--context", type=int, default=256, help="tokens already cached per sequence")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument(
        "--compare-hf", action="store_true", help="also time transformers on the same weights"
    )
    parser.add_argument(
        "--quantization", default="w8a8_int8", choices=["none", "w8a8_int8"], help="as the server's flag"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the runner's choice)"
    )
    parser.add_argument("--mixed", type=int, nargs=2, metavar=("NEW", "ROWS"), help="also time a mixed step")
    parser.add_argument("--mixed-prefix", type=int, default=128, help="cached prompt tokens before NEW")
    parser.add_argument("--kernel-times", action="store_true", help="each C kernel's share of a step")
    parser.add_argument("--verify-rows", type=int, default=0, help="also time verify steps of 1..N rows")
    parser.add_argument(
        "--verify-table",
        action="store_true",
        help="at each batch size, verify steps of 2..17 fed tokens a sequence against a decode step",
    )
    parser.add_argument(
        "--device", default="auto", help="as the server's flag (cuda: add --quantization none)"
    )
    parser.add_argument("--dtype", default="auto", help="as the server's flag")
    parser.add_argument(
        "--cuda-graph-max-bs", type=int, default=0, help="decode CUDA graphs up to this batch size (CUDA)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    runner = ModelRunner(
        resolve_model_dir(args.model_path),
        max_total_tokens=BENCH_KV_TOKENS,
        max_running_requests=max([*args.batch_sizes, args.mixed[1] + 1 if args.mixed else 1]),
        quantization=args.quantization,
        device=args.device,
        dtype=args.dtype,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
    )
    logger.info(
        "runner ready in %.2f s (weights %.2f s)", time.monotonic() - start, runner.load_weights_seconds
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    logger.info("torch threads: %d", torch.get_num_threads())
    hf = None
    if args.compare_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(runner.model_dir, dtype=torch.float32).eval()
    for bs in args.batch_sizes:
        step = time_decode(runner, bs, args.context, args.steps)
        line = f"decode bs={bs:3d} context={args.context}: {step * 1e3:7.1f} ms/step {bs / step:7.1f} tok/s"
        if hf is not None:  # measured right after ours so both see the same machine load
            hf_step = time_hf_decode(hf, bs, args.context, args.steps)
            line += (
                f" | hf {hf_step * 1e3:7.1f} ms/step {bs / hf_step:7.1f} tok/s | srt/hf {hf_step / step:.2f}x"
            )
        logger.info(line)
    seconds = time_prefill(runner, args.prefill, repeats=3)
    line = f"prefill {args.prefill} tokens: {seconds * 1e3:7.1f} ms {args.prefill / seconds:7.1f} tok/s"
    if hf is not None:
        hf_seconds = time_hf_prefill(hf, args.prefill, repeats=3)
        line += f" | hf {args.prefill / hf_seconds:7.1f} tok/s | srt/hf {hf_seconds / seconds:.2f}x"
    logger.info(line)
    if args.kernel_times:
        timed_with_kernels(
            args.kernel_times,
            f"prefill {args.prefill} tokens",
            lambda: time_prefill(runner, args.prefill, repeats=3),
            3,
        )
    if args.verify_rows:
        # one rows:ms pair a step size, and last the prefill's ms a prompt token (scripts/spec_replay.py)
        table = {
            r: time_verify(runner, r, args.context, max(args.steps, 15))
            for r in range(1, args.verify_rows + 1)
        }
        for r, step in table.items():
            logger.info("verify step, batch 1, %2d rows after %d: %6.2f ms", r, args.context, step * 1e3)
        pairs = ",".join(f"{r}:{step * 1e3:.2f}" for r, step in table.items())
        logger.info("--step-ms %s --prefill-ms-per-token %.3f", pairs, seconds * 1e3 / args.prefill)
    if args.verify_table:
        log_verify_table(runner, args)
    if args.mixed:
        new, rows = args.mixed
        timed_with_kernels(
            args.kernel_times,
            f"mixed step: {new} prompt tokens after {args.mixed_prefix}, {rows} decode rows at {args.context}",
            lambda: time_mixed(runner, new, args.mixed_prefix, rows, args.context, args.steps),
            WARMUP_STEPS + args.steps,
        )


if __name__ == "__main__":
    main()
