"""Grammar backends on this machine: JSON-schema compile time and per-token mask cost at batch 1 and 64.

    .venv/bin/python scripts/bench_grammar.py [--backends xgrammar llguidance] [--steps 40] [--repeats 3]
        [--workload nested|tools128]

For each backend: the compile time of a realistic JSON schema (nested objects, arrays, enums) with caching off
(median of `--repeats`), then a teacher-forced decode of a valid instance of the schema: at every step each
row's matcher fills its bitmask row, the batch's mask is applied to a `[batch, vocab]` logits tensor (srt's
one tensor op), and each matcher accepts the instance's next token. Printed: milliseconds per step for the
mask fill (mean and slowest step), for the apply, and microseconds per token (fill / batch). The tokenizer is
the embedded model's. `--workload tools128` is a forced tool choice over 128 tools (the list-of-calls schema
srt builds for `tool_choice: "required"`), the case a hostile probe once found stalling a server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from srt.constrained import GRAMMAR_BACKENDS, create_grammar_backend
from srt.constrained.base_backend import GrammarKey
from srt.constrained.bitmask import allocate_bitmask, apply_token_bitmask
from srt.model_source import resolve_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 40},
        "status": {"type": "string", "enum": ["active", "suspended", "deleted"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                },
            },
            "required": ["street", "city", "country"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty", "price"],
            },
        },
        "verified": {"type": "boolean"},
    },
    "required": ["id", "name", "status", "address", "tags", "orders", "verified"],
}
INSTANCE = {  # fmt: skip
    "id": 4711,
    "name": "Ada Lovelace",
    "status": "active",
    "address": {
        "street": "12 St James's Square",
        "city": "London",
        "country": "US",
        "geo": {"lat": 51.5, "lon": -0.13},
    },
    "tags": ["math", "engines", "poetry"],
    "orders": [{"sku": "AE-1843", "qty": 2, "price": 19.99}, {"sku": "NOTE-G", "qty": 1, "price": 4.5}],
    "verified": True,
}


def tools128() -> tuple[str, list]:
    from srt.function_call.tool_schema import tool_call_schema

    params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    spec = tool_call_schema([(f"f{i}", params) for i in range(128)], parallel=True)
    return spec, [{"name": "f83", "arguments": {"x": 12345}}, {"name": "f127", "arguments": {"x": -7}}]


WORKLOADS = {"nested": lambda: (json.dumps(SCHEMA), INSTANCE), "tools128": tools128}


def bench_backend(name: str, tokenizer, vocab_size: int, eos: list[int], args) -> dict:
    spec, instance = WORKLOADS[args.workload]()
    key = GrammarKey("json_schema", spec)
    compile_ms = []
    for _ in range(args.repeats):
        backend = create_grammar_backend(name, tokenizer, vocab_size, eos)  # fresh: nothing cached
        t0 = time.perf_counter()
        grammar = backend.compile(key)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    tokens = tokenizer(json.dumps(instance, separators=(",", ":")), add_special_tokens=False).input_ids
    steps = min(args.steps, len(tokens))
    result = {"backend": name, "compile_ms": statistics.median(compile_ms), "tokens": steps}
    for batch in (1, 64):
        matchers = [backend.new_matcher(grammar) for _ in range(batch)]
        bitmask = allocate_bitmask(batch, vocab_size)
        logits = torch.randn(batch, vocab_size)
        fill = apply = slowest = 0.0
        for step in range(steps):
            t0 = time.perf_counter()
            backend.fill_bitmask(matchers, bitmask)
            t1 = time.perf_counter()
            apply_token_bitmask(logits, bitmask, vocab_size)
            t2 = time.perf_counter()
            fill += t1 - t0
            slowest = max(slowest, t1 - t0)
            apply += t2 - t1
            for m in matchers:
                if not m.accept_token(tokens[step]):
                    raise RuntimeError(f"{name} rejected token {step} of a valid instance")
        result[f"fill_ms_b{batch}"] = fill / steps * 1e3
        result[f"max_fill_ms_b{batch}"] = slowest * 1e3
        result[f"apply_ms_b{batch}"] = apply / steps * 1e3
        result[f"us_per_token_b{batch}"] = fill / steps / batch * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", nargs="+", default=[b for b in GRAMMAR_BACKENDS if b != "none"])
    parser.add_argument(
        "--steps", type=int, default=40, help="decode steps measured (tokens of the instance)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="compiles per backend (median reported)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="nested", help="the schema measured")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = len(tokenizer)
    eos = [tokenizer.eos_token_id]
    print(f"tokenizer vocabulary {vocab_size}; torch threads {torch.get_num_threads()}")
    print(f"workload {args.workload}")
    header = (
        "backend      compile(ms)  fill b1(ms)  apply b1(ms)  fill b64(ms)  apply b64(ms)  us/token b1  "
        "us/token b64  slowest fill b1 / b64 (ms)"
    )
    print(header)
    for name in args.backends:
        r = bench_backend(name, tokenizer, vocab_size, eos, args)
        print(
            f"{name:<12} {r['compile_ms']:>11.1f}  {r['fill_ms_b1']:>11.3f}  {r['apply_ms_b1']:>12.3f}  "
            f"{r['fill_ms_b64']:>12.3f}  {r['apply_ms_b64']:>13.3f}  {r['us_per_token_b1']:>11.1f}  "
            f"{r['us_per_token_b64']:>12.1f}  {r['max_fill_ms_b1']:.3f} / {r['max_fill_ms_b64']:.3f}"
        )


if __name__ == "__main__":
    main()
