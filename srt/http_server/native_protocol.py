"""Request bodies of the native routes (`/generate`, `/abort_request`, `/flush_cache`), SGLang's shapes, built
from the same strict value types as the OpenAI models so both surfaces accept exactly the same values."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, PrivateAttr, model_validator

from srt.http_server.request_types import (
    MAX_COUNT,
    Count,
    FieldError,
    LogitBias,
    MinP,
    NativeInputIds,
    NativeTexts,
    NumSamples,
    Penalty,
    RepetitionPenalty,
    RequestBody,
    Rid,
    Seed,
    StopStrings,
    StopTokenIds,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
)
from srt.http_server.structured_output import ConstraintFields
from srt.sampling.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams


class NativeSamplingParams(ConstraintFields):
    """`/generate`'s `sampling_params`: SGLang's names; an unknown name is an error, not ignored."""

    max_new_tokens: Count = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: Count = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: StopStrings = Field(default_factory=list)
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: Seed | None = None
    logit_bias: LogitBias = None
    n: NumSamples = 1

    def to_sampling_params(
        self, logprobs: int | None, logprob_start_len: int | None = None
    ) -> SamplingParams:
        fields = self.model_dump(exclude={"n", "logit_bias"})
        return SamplingParams(
            **fields,
            logit_bias=self.logit_bias or None,
            logprobs=logprobs,
            logprob_start_len=logprob_start_len,
        )


class GenerateRequest(RequestBody):
    """Body of `/generate`: exactly one of `text` (one or several) and `input_ids` (one or several)."""

    route: ClassVar[str] = "/generate"

    text: NativeTexts = None
    # A bare `list`, as CompletionRequest.prompt: prompt_list checked every id.
    input_ids: NativeInputIds = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: Rid | None = None
    # SGLang's: run on this data-parallel replica (a gateway's --dp-aware routing); checked against --dp-size
    data_parallel_rank: Count | None = None
    # SGLang's: the LoRA adapter (a served adapter's name) every prompt runs with; none: the base model
    lora_path: str | None = None
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0
    # SGLang's: with `return_logprob`, prompt logprobs from this position on; -1 = none (output only).
    logprob_start_len: Annotated[int, Field(ge=-1, le=MAX_COUNT)] = -1

    _batched: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_shape(cls, data, handler) -> GenerateRequest:
        """Whether the answer is a list depends on the form the client sent (a list of texts or id lists)."""
        req = handler(data)
        ids = data.get("input_ids") if isinstance(data, dict) else None
        req._batched = isinstance(data.get("text"), list) or (bool(ids) and isinstance(ids[0], list))  # noqa: SLF001 (its own model, from its validator)
        return req

    @property
    def batched_input(self) -> bool:
        return self._batched

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise FieldError("exactly one of `text` and `input_ids` is required", "text")
        return self


class AbortRequest(RequestBody):
    """`{"rid": ...}` aborts one request (all its samples); `{"abort_all": true}` aborts every request.
    Anything else is a 400: an empty body must never mean "abort everything"."""

    route: ClassVar[str] = "/abort_request"

    rid: Rid | None = None
    abort_all: bool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> AbortRequest:
        if (self.rid is None) == (not self.abort_all):
            raise FieldError('send exactly one of `rid` and `"abort_all": true`', "rid")
        return self


class FlushCacheRequest(RequestBody):
    """`/flush_cache` takes no parameters: an empty body or `{}`."""

    route: ClassVar[str] = "/flush_cache"


class LoadLoRAAdapterRequest(RequestBody):
    """`/load_lora_adapter` (SGLang's body) and `/v1/load_lora_adapter` (vLLM's, without `pinned`)."""

    route: ClassVar[str] = "/load_lora_adapter"

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterRequest(RequestBody):
    """`/unload_lora_adapter` and `/v1/unload_lora_adapter`."""

    route: ClassVar[str] = "/unload_lora_adapter"

    lora_name: str
