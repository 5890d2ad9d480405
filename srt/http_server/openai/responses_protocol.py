"""`POST /v1/responses` bodies (OpenAI's Responses API, stateless) and their translation into a chat request.

srt serves the Responses API as an adapter over the chat pipeline (serving_responses.py): a body is checked
here with the same StrictModel rule as every route (an unknown key is a 400 naming it), then turned into the
`ChatCompletionRequest` it means, so the chat template, tool parsing and the grammar judge are the chat
route's own. srt keeps no state between requests: the fields that need stored responses (`store: true`,
`previous_response_id`, `conversation`, `background: true`) are a 400 naming the field; a gateway in front
of srt holds conversation state (docs/api.md, "The Responses API is stateless").
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, model_validator

from srt.http_server.openai.protocol import MAX_IDENTIFIER_CHARS, ChatCompletionRequest, Metadata
from srt.http_server.openai.tool_types import (
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOLS,
    FunctionDefinition,
    FunctionName,
)
from srt.http_server.request_types import (
    MAX_MESSAGES,
    FieldError,
    MinP,
    PositiveCount,
    RepetitionPenalty,
    RequestBody,
    StrictModel,
    Temperature,
    TopK,
    TopP,
)
from srt.http_server.structured_output import JsonSchemaFormat

Identifier = Annotated[str, Field(max_length=MAX_IDENTIFIER_CHARS)]
CallId = Annotated[str, Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)]
STATELESS = (
    "srt keeps no state between requests (the Responses API is served stateless: send the whole input)"
)
TEXT_ONLY = "srt reads text only"
# OpenAI Responses parameters of features srt does not have, with the reason; any value but null is a 400.
RESPONSES_REFUSED = {
    "previous_response_id": STATELESS,
    "conversation": STATELESS,
    "prompt": "srt stores no prompt templates",
    "reasoning": "srt has no reasoning-effort or summary control",
    "include": "srt returns no extra output data (logprobs, encrypted reasoning, tool sources)",
    "top_logprobs": "the Responses route returns no logprobs: use /v1/chat/completions",
    "max_tool_calls": "srt does not cap tool calls",
    "context_management": STATELESS,
    "background_options": STATELESS,
    "image": TEXT_ONLY,
    "moderation": "srt runs no moderation model",
    "access_programs": "srt serves no OpenAI platform programs",
}
# Content parts of kinds srt cannot read, refused by the key OpenAI carries them under.
FILE_PART_KEYS = ("image_url", "file_id", "file_data", "file_url", "filename", "detail")


class TextPart(StrictModel):
    """A text content part: `input_text` in input messages, `output_text` in assistant items sent back
    (the previous response's `output`, whose annotations and logprobs srt neither makes nor reads)."""

    refused: ClassVar[dict[str, str]] = dict.fromkeys(FILE_PART_KEYS, TEXT_ONLY)

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(StrictModel):
    """An input message (`type` optional, as OpenAI's EasyInputMessage), or a previous response's
    `message` output item sent back (with its `id` and `status`)."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None  # OpenAI's label of an assistant message (commentary / final answer): no effect

    @model_validator(mode="after")
    def _output_text_is_the_assistants(self) -> MessageItem:
        if not isinstance(self.content, str) and self.role != "assistant":
            if any(p.type == "output_text" for p in self.content):
                raise FieldError("only assistant messages may have `output_text` parts", "input")
        return self

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made (a previous response's `function_call` output item)."""

    type: Literal["function_call"]
    call_id: CallId
    name: FunctionName
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    """The client's result of a call: becomes the chat history's `tool` message."""

    type: Literal["function_call_output"]
    call_id: CallId
    output: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    """A previous response's `reasoning` item sent back: its text reaches the next assistant turn as that
    turn's thinking (interleaved thinking, docs/reasoning.md), never silently dropped."""

    refused: ClassVar[dict[str, str]] = {"encrypted_content": "srt never encrypts reasoning"}

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        """The full thinking where the item has it (`content`), else its summary."""
        return "".join(p.text for p in self.content or self.summary)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(StrictModel):
    """Responses' flat function tool; chat nests the same fields under `function`."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict:
        definition = FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict
        )
        return {"type": "function", "function": definition.model_dump(exclude_none=True)}


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: FunctionName


class TextFormat(StrictModel):
    """`text.format`: Responses' flat form of chat's `response_format` (`name`, `schema` beside `type`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise FieldError("`text.format` of type json_schema needs `name` and `schema`", "text.format")
        return self

    def to_chat(self) -> dict | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        schema = JsonSchemaFormat.model_validate(
            {
                "name": self.name,
                "description": self.description,
                "schema": self.schema_,
                "strict": self.strict,
            }
        )
        return {"type": "json_schema", "json_schema": schema.model_dump(by_alias=True, exclude_none=True)}


class TextConfig(StrictModel):
    refused: ClassVar[dict[str, str]] = {"verbosity": "srt has no verbosity control"}

    format: TextFormat | None = None


class ResponsesStreamOptions(StrictModel):
    # Accepted and ignored, as on chat: OpenAI pads events against size side channels; the text is the same.
    include_obfuscation: bool | None = None


def _false_only(name: str):
    def check(value: bool | None) -> bool | None:
        if value:
            raise ValueError(f"`{name}: true` is not supported: {STATELESS}")
        return value

    return AfterValidator(check)


def _zero_only(value: int | None) -> int | None:
    if value:
        raise ValueError("srt schedules without priorities: only 0, every request's priority, is accepted")
    return value


class ResponsesRequest(RequestBody):
    route: ClassVar[str] = "/v1/responses"
    refused: ClassVar[dict[str, str]] = RESPONSES_REFUSED

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: PositiveCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    # Stored state: false (or null) only, since srt stores nothing.
    store: Annotated[bool | None, _false_only("store")] = None
    background: Annotated[bool | None, _false_only("background")] = None
    truncation: Literal["disabled"] | None = None  # OpenAI's "auto" drops stored context srt does not have
    # Accepted and ignored, as on chat: metadata and routing hints with no effect on the output.
    metadata: Metadata | None = None
    user: Identifier | None = None
    safety_identifier: Identifier | None = None
    prompt_cache_key: Identifier | None = None
    prompt_cache_retention: Identifier | None = None
    service_tier: Identifier | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # SGLang's sampling extras, which the Shepherd Model Gateway sends on every request it proxies.
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    # SGLang's scheduling priority (the gateway sends 0): srt schedules without priorities, so only 0 is taken.
    priority: Annotated[int | None, AfterValidator(_zero_only)] = None

    @model_validator(mode="after")
    def _results_answer_calls(self) -> ResponsesRequest:
        """A `function_call_output` must answer an earlier `function_call` (as a chat tool message must)."""
        called: set[str] = set()
        for i, item in enumerate(self.items()):
            if isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
                raise FieldError(
                    f"input item {i} is a function_call_output for `call_id` {item.call_id!r}, which no "
                    "earlier function_call item has",
                    "input",
                )
            if isinstance(item, FunctionCallItem):
                called.add(item.call_id)
        self.chat_messages()  # a reasoning item with no assistant turn after it is a 400 here
        return self

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_messages(self) -> list[dict]:
        """The chat history the input means: `instructions` first as a system message; calls join the
        assistant turn that precedes them (or open one), results become tool messages, reasoning items
        become the thinking of the assistant turn that follows them."""
        messages: list[dict] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        thinking: str | None = None

        def assistant_turn() -> dict:
            """The assistant turn a call joins: the one just before, unless thinking opens a new one."""
            nonlocal thinking
            if thinking is not None or not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            if thinking is not None:
                messages[-1]["reasoning_content"] = thinking
                thinking = None
            return messages[-1]

        for item in self.items():
            if isinstance(item, ReasoningItem):
                thinking = (thinking or "") + item.text()
            elif isinstance(item, FunctionCallItem):
                function = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                assistant_turn().setdefault("tool_calls", []).append(call)
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            elif item.role == "assistant":
                messages.append({"role": "assistant", "content": item.text()})
                if thinking is not None:
                    messages[-1]["reasoning_content"] = thinking
                    thinking = None
            else:
                messages.append({"role": item.role, "content": item.text()})
        if thinking is not None:
            raise FieldError(
                "a reasoning input item must be followed by the assistant turn it belongs to", "input"
            )
        return messages

    def chat_body(self) -> dict:
        """The /v1/chat/completions body this request means (validated by ChatCompletionRequest)."""
        body: dict[str, Any] = {"messages": self.chat_messages()}
        optional = {
            "model": self.model,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if self.tools:
            body["tools"] = [t.to_chat() for t in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        response_format = self.text.format.to_chat() if self.text and self.text.format else None
        if response_format is not None:
            body["response_format"] = response_format
        if self.streaming:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request; a problem only the chat model checks (a tool choice naming no tool, a schema
        name) is the same 400 naming the field."""
        return ChatCompletionRequest.model_validate(self.chat_body())
