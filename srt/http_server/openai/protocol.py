"""Request bodies of the OpenAI-compatible routes, as strict pydantic models (types from request_types).

Field bounds live in the types, so a bad value is rejected by validation with the field's name (a 400) before
any work is queued. Fields OpenAI documents as nullable accept `null` and mean their default. Responses are
built as plain dicts by the serving modules, in OpenAI's exact shapes.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from srt.http_server.openai.tool_types import MessageToolCalls, ToolCallId, ToolFields
from srt.http_server.request_types import (
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
from srt.http_server.structured_output import OpenAIConstraintFields
from srt.sampling.sampling_params import SamplingParams

# OpenAI's default for /v1/completions when max_tokens is omitted.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    # vLLM's: with include_usage, every chunk also carries the usage of its choice so far (guidellm asks it)
    continuous_usage_stats: bool | None = None
    # Accepted and ignored: OpenAI pads stream chunks against size side channels; the text is the same.
    include_obfuscation: bool | None = None


# ---- every parameter honoured, refused or (metadata only) ignored: docs/api.md, "Parameters: honoured, refused or ignored", lists them all ----
# OpenAI's metadata limits: at most 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# Identifiers OpenAI only logs or routes by (user, safety_identifier, prompt_cache_key, service_tier).
MAX_IDENTIFIER_CHARS = 512


def _check_metadata(value: dict[str, str]) -> dict[str, str]:
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed, got {len(value)}")
    if any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS for k, v in value.items()):
        raise ValueError(
            f"keys may have at most {MAX_METADATA_KEY_CHARS} characters and values {MAX_METADATA_VALUE_CHARS}"
        )
    return value


def _text_only(value: list[str]) -> list[str]:
    if value != ["text"]:
        raise ValueError('only ["text"] is supported: srt generates text, not audio')
    return value


Metadata = Annotated[dict[str, str], AfterValidator(_check_metadata)]
Identifier = Annotated[str, Field(max_length=MAX_IDENTIFIER_CHARS)]
Modalities = Annotated[list[str], AfterValidator(_text_only)]
# OpenAI parameters of features srt does not have, with the reason; any value but null is a 400 naming them.
CHAT_REFUSED = {
    "audio": "srt generates text, not audio",
    "web_search_options": "srt has no web search",
    "functions": "the deprecated functions API is not served: use `tools`",
    "function_call": "the deprecated functions API is not served: use `tool_choice`",
    "reasoning_effort": "srt has no reasoning-effort control",
    "verbosity": "srt has no verbosity control",
    "moderation": "srt runs no moderation model",
}
COMPLETIONS_REFUSED = {"suffix": "srt has no fill-in-the-middle prompt format"}
# OpenAI's assistant-message fields srt has no use for: a client that sends a response's message back as
# history (`message.model_dump()`) sends them as null.
MESSAGE_REFUSED = {
    "audio": "srt generates text, not audio",
    "function_call": "the deprecated functions API is not served: use `tool_calls`",
    "refusal": "srt's answers carry no refusal",
}


class ContentPart(StrictModel):
    # OpenAI's other kinds of part, each carried under its own key
    refused: ClassVar[dict[str, str]] = dict.fromkeys(
        ("image_url", "input_audio", "file"), "srt reads text only"
    )

    type: Literal["text"]
    text: str


def joined_text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class Prediction(StrictModel):
    """OpenAI's Predicted Outputs: text much of the answer is expected to repeat (a file being edited).
    srt drafts from it and verifies every draft with the model (docs/speculative_decoding.md): the answer
    is what it would be without a prediction; a good prediction only makes it faster."""

    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return joined_text(self.content)


class SamplingFields(OpenAIConstraintFields, RequestBody):
    """Sampling fields shared by chat and completions, including SGLang's extras in the body.

    A parameter that is not a field is a 400 naming it (StrictModel's rule), never silently dropped."""

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
    user: Identifier | None = None  # ignored, as OpenAI does: an end-user id for abuse monitoring
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
    # SGLang's: run on this data-parallel replica (a gateway's --dp-aware routing); checked against --dp-size
    data_parallel_rank: Count | None = None
    # srt's: per-request timings in each choice (`timing`), docs/observability.md, "Per-request timings".
    return_timing: bool | None = None
    prediction: Prediction | None = None

    @property
    def num_samples(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: usage in every chunk only when the closing usage chunk is asked for too."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

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


class ChatMessage(StrictModel):
    refused: ClassVar[dict[str, str]] = MESSAGE_REFUSED

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: MessageToolCalls | None = None  # assistant turns that called tools
    tool_call_id: ToolCallId | None = None  # a tool's result answers this call
    # A previous turn's thinking sent back (interleaved thinking), under either name clients use for it
    # (docs/reasoning.md): SGLang's and DeepSeek's, or vLLM's.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldError("only assistant messages may have `tool_calls`", "messages")
        if self.thinking() is not None and self.role != "assistant":
            raise FieldError(
                "only assistant messages may have `reasoning_content` or `reasoning`", "messages"
            )
        if None not in (self.reasoning_content, self.reasoning) and self.reasoning_content != self.reasoning:
            raise FieldError(
                "`reasoning_content` and `reasoning` name the same thinking: give one, or both equal",
                "messages",
            )
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise FieldError("a tool message, and only a tool message, must have `tool_call_id`", "messages")
        return self

    def text(self) -> str:
        return joined_text(self.content or "")

    def thinking(self) -> str | None:
        """The turn's thinking, whichever name carried it."""
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


def _tool_results_answer_calls(messages: list[ChatMessage]) -> list[ChatMessage]:
    """A `tool` message must answer a call an earlier assistant message made (OpenAI answers 400 too): a
    result for no call would be rendered into the prompt as the answer to a call the model never made."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "tool" and m.tool_call_id not in called:
            raise FieldError(
                f"message {i} is a tool result for `tool_call_id` {m.tool_call_id!r}, which no earlier "
                "assistant message's `tool_calls` has",
                "messages",
            )
        called.update(c.id for c in m.tool_calls or ())
    return messages


# A chat's history, as /v1/chat/completions and /tokenize take it.
ChatMessages = Annotated[
    list[ChatMessage],
    Field(min_length=1, max_length=MAX_MESSAGES),
    AfterValidator(_tool_results_answer_calls),
]


class ChatCompletionRequest(ToolFields, SamplingFields):
    route: ClassVar[str] = "/v1/chat/completions"
    refused: ClassVar[dict[str, str]] = CHAT_REFUSED

    messages: ChatMessages
    modalities: Modalities | None = None
    # Accepted and ignored, as OpenAI documents them: storage, billing and caching hints, no effect on output.
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: Identifier | None = None
    safety_identifier: Identifier | None = None
    prompt_cache_key: Identifier | None = None
    prompt_cache_retention: Identifier | None = None
    prompt_cache_options: dict[str, Any] | None = None
    max_tokens: PositiveCount | None = None
    max_completion_tokens: PositiveCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    # SGLang's: false returns the raw output (thinking and tags in `content`) on a --reasoning-parser server.
    separate_reasoning: bool = True
    # SGLang's and vLLM's: extra variables for the chat template (Qwen3's `enable_thinking`).
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("`top_logprobs` requires `logprobs` to be true", "top_logprobs")
        return self

    @property
    def thinking_enabled(self) -> bool:
        """False when the request turned thinking off the way Qwen3's template reads it."""
        return (self.chat_template_kwargs or {}).get("enable_thinking", True) is not False

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    route: ClassVar[str] = "/v1/completions"
    refused: ClassVar[dict[str, str]] = COMPLETIONS_REFUSED

    # Any of OpenAI's four prompt forms, normalised to a list of prompts (each text or token ids). A bare
    # `list`: prompt_list checked every item at C speed, and pydantic's per-item pass would cost 5x that.
    prompt: Annotated[list, BeforeValidator(lambda v: prompt_list(v, "prompt"))]
    # 0 is allowed (OpenAI and lm-evaluation-harness score a prompt with `echo` + `logprobs` + 0 tokens).
    max_tokens: Count | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    # vLLM's: generate best_of samples per prompt, return the n with the highest cumulative logprob.
    best_of: NumSamples | None = None

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.num_samples:
            raise FieldError(f"`best_of` ({self.best_of}) must be >= `n` ({self.num_samples})", "best_of")
        if self.num_generated > self.num_samples and self.streaming:
            raise FieldError("`best_of` > `n` cannot be streamed: the best are known at the end", "best_of")
        return self

    @property
    def num_generated(self) -> int:
        """Samples generated per prompt: `best_of`, of which `n` are returned."""
        return self.best_of or self.num_samples

    def prompts(self) -> list[str | list[int]]:
        return list(self.prompt)

    @property
    def max_new_tokens(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
