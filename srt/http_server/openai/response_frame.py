"""What a chat or a completions response repeats in its body and in every chunk, built in one place for both:
the frame (id, object, creation time, model), each choice's `timing`, the usage (prompt and completion tokens,
cached tokens, reasoning tokens, accepted and rejected prediction tokens) and vLLM's speculative `metrics`
block. The Responses API reads chat's usage (`serving_responses.responses_usage`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from srt.http_server.openai.protocol import SamplingFields
from srt.http_server.openai.serving_common import ChoiceAcc, sse, timing, wants_timing
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.metrics.request_stats import FinishedRequestStats
from srt.server_args import ServerArgs
from srt.speculative.defaults import PREDICTION_DRAFTS_PER_STEP
from srt.speculative.stats import SpecRequestStats


@dataclass(frozen=True)
class ResponseFrame:
    """One response's frame and usage rule. `kind`: the body's `object` ("chat.completion",
    "text_completion"), `chunk_kind` its chunks'. `n`: samples generated per prompt (usage counts each prompt
    once). `predicted`: the request sent a `prediction` (its accepted and rejected tokens are counted).
    `reasoning`: the output's thinking is counted (a --reasoning-parser server). `timed`: each finished choice
    carries its `timing`. `include_usage`, `continuous_usage`: the stream's usage members (`chunk_usage`)."""

    rid: str
    kind: str
    chunk_kind: str
    created: int
    model: str
    n: int
    predicted: bool
    reasoning: bool
    timed: bool
    include_usage: bool
    continuous_usage: bool
    args: ServerArgs

    @classmethod
    def of(
        cls,
        tm: TokenizerManager,
        req: SamplingFields,
        rid: str,
        kind: str,
        model: str,
        n: int,
        reasoning: bool,
        chunk_kind: str | None = None,
    ) -> ResponseFrame:
        """`req`'s frame, created now."""
        return cls(
            rid=rid,
            kind=kind,
            chunk_kind=chunk_kind or kind,
            created=int(time.time()),
            model=model,
            n=n,
            predicted=req.prediction is not None,
            reasoning=reasoning,
            timed=wants_timing(tm, req.return_timing),
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            args=tm.server_args,
        )

    def usage(self, choices: list[ChoiceAcc]) -> dict:
        """The whole response's usage over every generated sample (`usage`)."""
        return usage(choices, self.n, self.predicted, reasoning_tokens(self.reasoning, choices))

    def timed_choice(self, choice: dict, stats: FinishedRequestStats | None) -> dict:
        """`choice` with its `timing` (from `stats`, its finished record) when the response carries timings."""
        if self.timed:
            choice["timing"] = timing(stats)
        return choice

    def body(self, choices: list[dict], samples: list[ChoiceAcc]) -> dict:
        """A non-streaming body: the returned `choices`, the usage of every generated sample and vLLM's
        `metrics` block where the server adds it."""
        body = {
            "id": self.rid,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(samples),
        }
        metrics = spec_metrics_block(self.args, samples, self.predicted)
        if metrics is not None:
            body["metrics"] = metrics
        return body

    def chunk(self, choice: dict, so_far: ChoiceAcc, stats: FinishedRequestStats | None = None) -> str:
        """One stream chunk of `choice`, with its usage member (`so_far`: the choice's output until now); the
        chunk that finishes the choice carries its `timing` (from `stats`)."""
        if choice["finish_reason"] is not None:
            self.timed_choice(choice, stats)
        extra = chunk_usage(self.include_usage, self.continuous_usage, so_far)
        return stream_chunk(self.rid, self.chunk_kind, self.created, self.model, choice, extra)

    def closing_chunks(self, accs: list[ChoiceAcc]) -> list[str]:
        """The stream's closing usage chunk, when `stream_options.include_usage` asked for it."""
        if not self.include_usage:
            return []
        metrics = spec_metrics_block(self.args, accs, self.predicted)
        return [usage_chunk(self.rid, self.chunk_kind, self.created, self.model, self.usage(accs), metrics)]


def usage(
    choices: list[ChoiceAcc], n: int, predicted: bool = False, reasoning_tokens: list[int] | None = None
) -> dict:
    """OpenAI usage. Each prompt counts once, however many samples (`n`) it has, in `prompt_tokens` and in
    `cached_tokens` alike: a prompt's cached tokens are those of its first sample (choice index `p * n`), so
    cached never exceeds prompt. Completion tokens are summed over every sample. `/metrics`' token counters
    follow the same rule (RequestMetricsRecorder). With a `prediction` (`predicted`), OpenAI's
    `completion_tokens_details`: the prediction's tokens accepted and rejected, summed over every sample
    (each drafted from it), as `sglang:{accepted,rejected}_prediction_tokens_total` count them. On a
    `--reasoning-parser` server (`reasoning_tokens`: each choice's), OpenAI's `reasoning_tokens` there too,
    summed over every sample (a part of `completion_tokens`)."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices)
    cached = sum(c.cached_tokens for c in firsts)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    details: dict = {}
    if predicted:
        details.update(merged_spec_stats(choices).prediction_usage())
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = sum(reasoning_tokens)
    if details:
        out["completion_tokens_details"] = details
    return out


def reasoning_tokens(parsed: bool, choices: list[ChoiceAcc]) -> list[int] | None:
    """Each choice's reasoning tokens as its finished record counted them (the request metrics recorder,
    with or without `separate_reasoning`); None when the output was not read (`parsed`: a --reasoning-parser
    server)."""
    if not parsed:
        return None
    return [(c.stats.reasoning_tokens or 0) if c.stats is not None else 0 for c in choices]


def chunk_usage(include_usage: bool, continuous: bool, choice: ChoiceAcc) -> dict:
    """The `usage` member of a stream chunk: none without `include_usage`, null while usage comes in the
    closing chunk only, and with vLLM's `continuous_usage_stats` the choice's prompt and the tokens it has
    generated so far (the closing chunk still counts the whole request: `usage`)."""
    if not include_usage:
        return {}
    if not continuous:
        return {"usage": None}
    prompt, completion = choice.prompt_tokens, choice.completion_tokens
    return {
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
    }


def merged_spec_stats(choices: list[ChoiceAcc]) -> SpecRequestStats:
    """The choices' speculative figures added up (a choice without verify steps adds nothing)."""
    total = SpecRequestStats()
    for c in choices:
        if c.spec_stats is not None:
            total.add(c.spec_stats)
    return total


def spec_metrics_block(args: ServerArgs, choices: list[ChoiceAcc], predicted: bool) -> dict | None:
    """vLLM's top-level `metrics` object with its per-request speculative decoding block (its
    `--per-request-spec-decode-metrics summary`), over every choice of the response; None when the
    server was not started with it. `num_spec_tokens`: the most drafts a step gave a choice (a
    prediction's, or the algorithm's)."""
    if not args.per_request_spec_decode_metrics:
        return None
    block = merged_spec_stats(choices).vllm_block()
    block["num_spec_tokens"] = PREDICTION_DRAFTS_PER_STEP if predicted else args.speculative_drafts_per_step
    return {"speculative_decoding": block}


def stream_chunk(rid: str, kind: str, created: int, model: str, choice: dict, extra: dict) -> str:
    """One SSE chunk in OpenAI's shape: a single choice, plus its `usage` member (`chunk_usage`)."""
    return sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [choice], **extra})


def usage_chunk(
    rid: str, kind: str, created: int, model: str, usage_dict: dict, metrics: dict | None = None
) -> str:
    """The closing chunk of `stream_options.include_usage`: no choices, the whole request's usage (and
    vLLM's `metrics` object where the server adds it)."""
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": usage_dict}
    if metrics is not None:
        body["metrics"] = metrics
    return sse(body)
