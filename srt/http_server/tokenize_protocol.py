"""Bodies of `/tokenize` and `/detokenize` (also under `/v1/`): vLLM's fields, and SGLang's batch of texts.

`/tokenize` takes a `prompt` (a text, or a list of texts) or chat `messages` (with `tools`, as the chat route
takes them) and answers the token ids that `/v1/completions` or `/v1/chat/completions` would prefill.
Unknown fields are refused by name, as on the generation routes.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from srt.http_server.openai.protocol import ChatMessages
from srt.http_server.openai.tool_types import ToolFields
from srt.http_server.request_types import MAX_PROMPTS, FieldError, RequestBody


class TokenizeRequest(ToolFields, RequestBody):
    route: ClassVar[str] = "/tokenize"
    model: str | None = None
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | None = None
    messages: ChatMessages | None = None
    # None: the generation routes' own choice (special tokens for a prompt; none past the chat template)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages only: end with the assistant turn's opening
    return_token_strs: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value: Any) -> Any:
        """One message for every wrong form (pydantic's would name a branch of the union)."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ValueError("must be a text or a list of texts")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("give exactly one of `prompt` and `messages`", "prompt")
        if self.messages is None and (self.tools is not None or self.tool_choice is not None):
            raise FieldError("`tools` and `tool_choice` go with `messages`", "tools")
        return self

    @property
    def batched(self) -> bool:
        return isinstance(self.prompt, list)


class DetokenizeRequest(RequestBody):
    route: ClassVar[str] = "/detokenize"
    model: str | None = None
    # At most the model's context length (`max_model_len`) ids, each in the vocabulary: the handler checks
    # both, as it knows the model. A longer list costs its parsing first, bounded by --max-request-bytes: for
    # 4,000,000 ids (8 MB) 0.25 s of JSON, 0.11 s of RequestBody's text scan, 0.11 s of this strict int check,
    # as any route pays for a body of ids (a prompt of ids on /v1/completions: more).
    tokens: list[int]
