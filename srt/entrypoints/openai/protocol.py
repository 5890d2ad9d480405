"""Request bodies of the OpenAI-compatible and native routes, as pydantic models.

Field bounds live here so a bad value is rejected by validation with the field's name (a 400), before any
work is queued. Responses are built as plain dicts by the serving modules, in OpenAI's exact shapes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from srt.sampling.sampling_params import SamplingParams

# Most samples per request: bounds the work one HTTP request can queue.
MAX_N = 64
# OpenAI allows at most 20 top logprobs per token.
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by chat and completions, including SGLang's extras in the body."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # SGLang extras
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    rid: str | None = None

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stops[:MAX_STOP_STRINGS]

    def to_sampling_params(self, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            seed=self.seed,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content if part.type == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# OpenAI's default for /v1/completions when max_tokens is omitted.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class GenerateRequest(BaseModel):
    """Body of the native `/generate` route (SGLang's shape)."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)


class AbortRequest(BaseModel):
    rid: str = ""
