"""Replays the lookup proposers over recorded greedy answers: what each drafting rule would buy at batch 1,
without a benchmark run per setting, and the most any drafter that copies from the request's own tokens
could buy.

Greedy speculation is lossless, so a request's answer is the same whatever the drafts: record each answer
once from a server without speculation, then replay the proposers (srt's own `NgramProposer` and
`PredictionProposer`) step by step over it. A step feeds the newest token and its drafts; the drafts the
answer continues with are accepted, plus one token. Each step costs what a batch-1 verify step of that many
rows costs on the machine (`--step-ms`, from `scripts/bench_model_forward.py --verify-rows 16`), each prompt
its prefill; the ratio is against one decode step a token. The bound: at every step draft the longest run
of the answer's next tokens that occurs anywhere in the prompt and the output so far, of the length that
maximizes tokens per millisecond: no lookup proposer, predictions included (their text is in the prompt
here), does better at any step (a bound step by step: the test checks proposers against it).

    python -m srt.launch_server --port 30000 &
    python scripts/bench_model_forward.py --batch-sizes 1 --context 300 --verify-rows 16   # prints --step-ms
    python scripts/spec_replay.py --base-url http://127.0.0.1:30000 --step-ms 1:7.4,...,16:21.0 \
        --prefill-ms-per-token 0.73

A model of the step's cost, not a measurement of the server: scripts/bench_spec.py measures. The runner's
costs flatter short verify steps: on a 2-core server, where the HTTP and detokenizer processes share the
cores, a 4-row step cost 1.28x a decode step against the runner's 1.17x, and a rule for predictions that
replayed 7 % faster ran 7 % slower there. Confirm a replayed gain with bench_spec before adopting it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from srt.model_source import resolve_model_dir
from srt.speculative.lookup import EVERY_MATCH_DRAFTS_K, DraftLength, LookupProposer
from srt.speculative.ngram import NgramProposer
from srt.speculative.prediction import PredictionProposer
from srt_bench.dataset import load_tokenizer
from srt_bench.grounded import OPEN_QUESTIONS, load_records

DEFAULT_WORKLOAD = "scripts/data/grounded_prompts.jsonl"


@dataclass
class Answer:
    kind: str  # "grounded" or "open"
    prompt_ids: list[int]
    output_ids: list[int]
    prediction_ids: list[int] | None


@dataclass
class ReplayReq:
    """What a proposer reads of a request (`SpecRequest`, `PredictionRequest`)."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    prediction_ids: list[int] | None = None


def record(base_url: str, tokenizer, max_tokens: int, workload: str) -> list[Answer]:
    """Each grounded prompt and open question once, greedy, through `/generate` on the chat template's ids."""
    items = [("grounded", r["prompt"], r["original"]) for r in load_records(workload)]
    items += [("open", q, None) for q in OPEN_QUESTIONS]
    answers = []
    with httpx.Client(timeout=600) as client:
        for kind, prompt, original in items:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
            out = client.post(f"{base_url}/generate", json=body)
            out.raise_for_status()
            predicted = tokenizer.encode(original, add_special_tokens=False) if original else None
            answers.append(Answer(kind, ids, out.json()["output_ids"], predicted))
    return answers


class StepCost:
    def __init__(self, step_ms: dict[int, float], prefill_ms_per_token: float):
        self.rows = sorted(step_ms)
        self.ms = [step_ms[r] for r in self.rows]
        self.prefill_ms_per_token = prefill_ms_per_token

    def __call__(self, rows: int) -> float:
        return float(np.interp(rows, self.rows, self.ms))  # past the table: its last step's cost


def accepted(drafts: list[int], answer: list[int], at: int) -> int:
    n = 0
    while n < len(drafts) and at + n < len(answer) and drafts[n] == answer[at + n]:
        n += 1
    return n


def prefill_and_plain_ms(a: Answer, cost: StepCost) -> tuple[float, float]:
    """The answer's prefill, and its whole time without speculation (the prefill, then a decode step a token)."""
    prefill = cost.prefill_ms_per_token * len(a.prompt_ids)
    return prefill, prefill + cost(1) * (len(a.output_ids) - 1)


def replay(answers: list[Answer], make: Callable[[], LookupProposer], cost: StepCost) -> tuple[float, int]:
    """(speed-up over no speculation, verify and decode steps) of one proposer over every answer."""
    spec_ms = plain_ms = 0.0
    steps = 0
    for i, a in enumerate(answers):
        proposer, (prefill, plain) = make(), prefill_and_plain_ms(a, cost)
        plain_ms += plain
        spec_ms += prefill
        req = ReplayReq(str(i), a.prompt_ids, a.output_ids[:1], a.prediction_ids)
        at = 1  # the prefill gave the first token
        while at < len(a.output_ids):
            drafts = proposer.propose([req], [len(a.output_ids) - at]).token_ids[0]
            n = accepted(drafts, a.output_ids, at)
            spec_ms += cost(1 + len(drafts))
            steps += 1
            req.output_ids = a.output_ids[: at + n + 1]
            at += n + 1
    return plain_ms / spec_ms, steps


def longest_copy(history: list[int], answer: list[int], at: int, most: int) -> int:
    """How many of the answer's next tokens (up to `most`) occur as one run somewhere in `history`."""
    hay = np.asarray(history, dtype=np.int64)
    n = 0
    while n < most and at + n < len(answer):
        run = answer[at : at + n + 1]
        starts = np.flatnonzero(hay[: len(hay) - n] == run[0]) if len(hay) > n else []
        if not any(hay[s : s + n + 1].tolist() == run for s in starts):
            break
        n += 1
    return n


def bound(answers: list[Answer], cost: StepCost, most: int) -> tuple[float, int]:
    spec_ms = plain_ms = 0.0
    steps = 0
    best = {m: max(range(m + 1), key=lambda d: (d + 1) / cost(d + 1)) for m in range(most + 1)}
    for a in answers:
        prefill, plain = prefill_and_plain_ms(a, cost)
        plain_ms += plain
        spec_ms += prefill
        at = 1
        while at < len(a.output_ids):
            d = best[longest_copy(a.prompt_ids + a.output_ids[:at], a.output_ids, at, most)]
            spec_ms += cost(1 + d)
            steps += 1
            at += d + 1
    return plain_ms / spec_ms, steps


def configurations(k: int) -> dict[str, tuple[str, Callable[[], LookupProposer]]]:
    """name: (which answers, proposer factory): srt's defaults, then the rules they were chosen against."""
    every = EVERY_MATCH_DRAFTS_K
    return {
        "NGRAM (srt's defaults: 2-token window, 3 drafts below 4 tokens)": (
            "both",
            lambda: NgramProposer(k=k),
        ),
        "NGRAM, 1-token window": ("both", lambda: NgramProposer(min_n=1, k=k)),
        "NGRAM, 2-token window, k drafts whatever the match": (
            "both",
            lambda: NgramProposer(k=k, length=every),
        ),
        "NGRAM, 2-token window, 3 drafts below 3 tokens": (
            "both",
            lambda: NgramProposer(k=k, length=DraftLength(3, 3)),
        ),
        "prediction (srt's defaults: 3-token window, 7 drafts whatever the match; or its own tokens' NGRAM "
        "match where longer)": (
            "grounded",
            lambda: PredictionProposer(),
        ),
        "prediction alone": ("grounded", lambda: PredictionProposer(own_tokens=None)),
        "prediction, 1-token window, 3 drafts below 4 tokens": (
            "grounded",
            lambda: PredictionProposer(min_n=1, length=DraftLength()),
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="an srt server without speculation, to record the answers from")
    p.add_argument(
        "--answers", default=None, help="JSON of recorded answers: read if it exists, else written"
    )
    p.add_argument(
        "--model-path", default=None, help="the served model's tokenizer (default: the embedded model)"
    )
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--step-ms", required=True, help="rows:ms,... a batch-1 verify step's cost by fed rows")
    p.add_argument("--prefill-ms-per-token", type=float, required=True)
    p.add_argument("--num-draft-tokens", type=int, default=9, help="NGRAM's positions a step (k + 1)")
    p.add_argument("--bound-drafts", type=int, default=15, help="the bound's most drafts a step")
    args = p.parse_args()
    cost = StepCost(
        {int(r): float(ms) for r, ms in (pair.split(":") for pair in args.step_ms.split(","))},
        args.prefill_ms_per_token,
    )
    answers = None
    if args.answers:
        try:
            with open(args.answers) as f:
                answers = [Answer(**a) for a in json.load(f)]
        except FileNotFoundError:
            pass
    if answers is None:
        if not args.base_url:
            p.error("--base-url is needed to record the answers")
        answers = record(
            args.base_url, load_tokenizer(resolve_model_dir(args.model_path)), args.max_tokens, args.workload
        )
        if args.answers:
            with open(args.answers, "w") as f:
                json.dump([a.__dict__ for a in answers], f)
    by_kind = {kind: [a for a in answers if a.kind == kind] for kind in ("grounded", "open")}
    print(
        f"{len(by_kind['grounded'])} grounded answers, {len(by_kind['open'])} open; speed-up over no speculation"
    )
    print("| rule | grounded | open |\n|---|---|---|")
    for name, (which, make) in configurations(args.num_draft_tokens - 1).items():
        cells = [
            "{:.2f}x ({} steps)".format(*replay(by_kind[kind], make, cost))
            if which in (kind, "both")
            else "-"
            for kind in ("grounded", "open")
        ]
        print(f"| {name} | {' | '.join(cells)} |")
    cells = [
        "{:.2f}x ({} steps)".format(*bound(by_kind[kind], cost, args.bound_drafts))
        for kind in ("grounded", "open")
    ]
    print(
        f"| bound: the longest copy from prompt + output, up to {args.bound_drafts} drafts | {' | '.join(cells)} |"
    )


if __name__ == "__main__":
    main()
