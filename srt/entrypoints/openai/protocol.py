"""Request bodies of the OpenAI-compatible routes, as strict pydantic models (types from request_types).

Field bounds live in the types, so a bad value is rejected by validation with the field's name (a 400) before
any work is queued. Fields OpenAI documents as nullable accept `null` and mean their default. Responses are
built as plain dicts by the serving modules, in OpenAI's exact shapes.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from srt.entrypoints.request_types import (
    MAX_MESSAGES,
    Count,
    FieldError,
    LogitBias,
    MinP,
    NumSamples,
    Penalty,
    PositiveCount,
    RepetitionPenalty,
    RequestBody,
    Rid,
    Seed,
    StopStrings,
    StopTokenIds,
    StrictModel,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    prompt_list,
)
from srt.entrypoints.structured_output import OpenAIConstraintFields
from srt.sampling.sampling_params import SamplingParams

# OpenAI's default for /v1/completions when max_tokens is omitted.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class SamplingFields(OpenAIConstraintFields, RequestBody):
    """Sampling fields shared by chat and completions, including SGLang's extras in the body."""

    model: str | None = None
    n: NumSamples | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: StopStrings = Field(default_factory=list)
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    logit_bias: LogitBias = None
    # SGLang extras
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_tokens: Count = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: StopTokenIds | None = None
    rid: Rid | None = None

    @property
    def num_samples(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            seed=self.seed,
            logit_bias=self.logit_bias or None,
            logprobs=logprobs,
            **self.constraint(),
        )


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: PositiveCount | None = None
    max_completion_tokens: PositiveCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    # Any of OpenAI's four prompt forms, normalised to a list of prompts (each text or token ids). A bare
    # `list`: prompt_list checked every item at C speed, and pydantic's per-item pass would cost 5x that.
    prompt: Annotated[list, BeforeValidator(lambda v: prompt_list(v, "prompt"))]
    # 0 is allowed (OpenAI and lm-evaluation-harness score a prompt with `echo` + `logprobs` + 0 tokens).
    max_tokens: Count | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: TopLogprobs | None = None
    echo: bool | None = None

    def prompts(self) -> list[str | list[int]]:
        return list(self.prompt)

    @property
    def max_new_tokens(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
