"""The speculative decoding benchmark's workloads, its batch-1 runner and what it reads from the server.

Drafts copied from the prompt (n-gram lookup) or from the client's own guess (OpenAI's Predicted Outputs)
are accepted often only when the answer repeats the input. So the benchmark needs an input-grounded workload
(edit this function, rewrite this paragraph with one change, answer with quotes from this passage), where
speculation must pay, and open questions whose answers copy nothing, where it must step aside. Each grounded
record keeps `original`, the text its answer should mostly copy, so the same record can also be sent with
`prediction` set to that text.

Answers are greedy and end on their own (EOS), capped by `max_tokens`: a fixed output length would force the
model to keep writing past the copy, which is not what an editing user sees.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from srt_bench.backends import Target, send_request
from srt_bench.dataset import BenchRequest, prompt_token_count
from srt_bench.prom import Snapshot
from srt_bench.runner import RunResult, new_session, run_interleaved
from srt_bench.stats import summarize

KINDS = ("edit_function", "rewrite_paragraph", "quote_passage")
OPEN_KIND = "open"
RECORD_KEYS = {"kind", "prompt", "original"}
# Counters srt writes only while speculation is on; their difference over a run gives its acceptance length.
ACCEPTED_METRIC = "sglang:spec_decode_num_accepted_tokens_total"
DRAFTS_METRIC = "sglang:spec_decode_num_drafts_total"

# Short questions whose answers the prompt does not contain: n-gram lookup finds little to copy.
OPEN_QUESTIONS = (
    "Why do leaves change colour in autumn?",
    "What makes a good first paragraph in a short story?",
    "How does a bicycle stay upright when it is moving?",
    "Give three tips for keeping a small vegetable garden healthy.",
    "What is the difference between weather and climate?",
    "Explain how a refrigerator keeps food cold.",
    "Why is sleep important for learning?",
    "Describe a pleasant walk through a city park in the morning.",
    "What should someone pack for a two-day hiking trip?",
    "How do bees make honey?",
    "What are the benefits of learning a second language?",
    "Explain what a budget is and why families use one.",
    "Why does bread rise when it bakes?",
    "Write a short note thanking a neighbour for watering your plants.",
    "How can a student prepare for an exam in one week?",
    "What causes the tides in the ocean?",
    "Suggest a simple dinner that can be cooked in twenty minutes.",
    "Why do people keep dogs as pets?",
    "How does a library decide which books to buy?",
    "What is a volcano and why does it erupt?",
    "Describe the job of a lighthouse keeper.",
    "Why is it a good idea to drink water during exercise?",
    "How would you explain the internet to a child?",
    "What are some ways to save energy at home?",
    "Write a short poem about the first snow of winter.",
    "Why do some birds fly south for the winter?",
    "What makes a team work well together?",
    "How is paper made from trees?",
    "Give advice to someone starting their first job.",
    "What happens to a letter after it is posted?",
)


@dataclass
class SpecRequest(BenchRequest):
    """A benchmark request that may carry the text its answer should copy (None: an open question)."""

    kind: str = OPEN_KIND
    original: str | None = None

    @property
    def prediction_fields(self) -> dict:
        """OpenAI's Predicted Outputs field for this request; nothing for a request with no original."""
        if self.original is None:
            return {}
        return {"prediction": {"type": "content", "content": self.original}}


def check_record(record: dict) -> None:
    """Raise ValueError unless `record` is a grounded record whose original the prompt quotes verbatim: a
    prediction that is not in the prompt would measure the client's guess, not the input's grounding."""
    if set(record) != RECORD_KEYS:
        raise ValueError(f"a record has the keys {sorted(RECORD_KEYS)}, got {sorted(record)}")
    if record["kind"] not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {record['kind']!r}")
    if not record["original"] or record["original"] not in record["prompt"]:
        raise ValueError(f"the original must occur verbatim in its prompt: {record['prompt'][:80]!r}")


def load_records(path: str) -> list[dict]:
    """The grounded workload, one JSON record a line, each checked."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    for record in records:
        check_record(record)
    return records


def grounded_requests(records: list[dict], tokenizer, max_tokens: int) -> list[SpecRequest]:
    return [
        SpecRequest(
            r["prompt"],
            prompt_token_count(tokenizer, r["prompt"], True),
            max_tokens,
            r["kind"],
            r["original"],
        )
        for r in records
    ]


def open_requests(tokenizer, max_tokens: int) -> list[SpecRequest]:
    return [SpecRequest(q, prompt_token_count(tokenizer, q, True), max_tokens) for q in OPEN_QUESTIONS]


async def run_one_by_one(
    target: Target, requests: list[SpecRequest], count_tokens: Callable[[str], int], with_prediction: bool
) -> RunResult:
    """Send the requests one after another (batch 1), each with its own prediction when asked.

    `run_benchmark` sends one body shape for a whole run; Predicted Outputs needs a field per request, so
    this loop gives each request its own `Target` with the field in `extra_body`."""
    results = []
    async with new_session() as session:
        start = time.perf_counter()
        for req in requests:
            extra = {**target.extra_body, **req.prediction_fields} if with_prediction else target.extra_body
            results.append(
                await send_request(session, replace(target, extra_body=extra), req, count_tokens, start)
            )
        duration = time.perf_counter() - start
    return RunResult(1, math.inf, results, summarize(results, duration), None)


async def run_paired(
    targets: list[Target],
    requests: list[SpecRequest],
    count_tokens: Callable[[str], int],
    with_prediction: list[bool],
) -> list[RunResult]:
    """Each request sent to every target in turn, one at a time (batch 1), with its prediction where asked
    (`run_interleaved`: each target timed on its own requests)."""
    arms = []
    for target, predicted in zip(targets, with_prediction, strict=True):
        arms.append(
            [
                (replace(target, extra_body={**target.extra_body, **req.prediction_fields}), req)
                if predicted
                else (target, req)
                for req in requests
            ]
        )
    return await run_interleaved(arms, count_tokens)


@dataclass(frozen=True)
class SpecFigures:
    """What the server's counters say about one run: verify steps that had drafts, drafts accepted."""

    drafts: float
    accepted: float

    @classmethod
    def between(cls, before: Snapshot | None, after: Snapshot | None) -> SpecFigures | None:
        """None when the server has no `/metrics` or writes no speculative counters (speculation off)."""
        if before is None or after is None or DRAFTS_METRIC not in after:
            return None
        return cls(
            drafts=after[DRAFTS_METRIC] - before.get(DRAFTS_METRIC, 0.0),
            accepted=after.get(ACCEPTED_METRIC, 0.0) - before.get(ACCEPTED_METRIC, 0.0),
        )

    @property
    def accept_length(self) -> float | None:
        """Tokens a request gained per verify step that had drafts: 1 + accepted / drafts."""
        return 1 + self.accepted / self.drafts if self.drafts > 0 else None


def identical_outputs(reference: RunResult, run: RunResult) -> tuple[int, int]:
    """(identical, compared): requests both runs completed whose generated texts are equal. Greedy decoding
    with speculation must change no token, so anything below compared == identical is a bug."""
    pairs = [
        (a.generated_text, b.generated_text)
        for a, b in zip(reference.results, run.results, strict=True)
        if a.success and b.success
    ]
    return sum(a == b for a, b in pairs), len(pairs)
