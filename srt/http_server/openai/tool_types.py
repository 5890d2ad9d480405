"""Request fields of OpenAI function tools on `/v1/chat/completions`: `tools`, `tool_choice`,
`parallel_tool_calls`, and the `tool_calls` / `tool_call_id` of history messages.

Checked here (a 400 naming the field): the shapes, names matching OpenAI's `^[a-zA-Z0-9_-]{1,64}$` and unique,
at most MAX_TOOLS tools, parameters a JSON object, a named choice naming a given tool, a forced choice not
combined with another constraint. A forced choice (`required` or named) becomes the request's `json_schema`
constraint (srt/function_call/tool_schema.py), so the grammar backend validates the parameters' schemas too.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from srt.function_call.tool_schema import tool_call_schema
from srt.http_server.request_types import FieldError, StrictModel
from srt.http_server.structured_output import MAX_GRAMMAR_CHARS

# OpenAI's documented maximum number of tools per request.
MAX_TOOLS = 128
# Calls in one history message: a model never makes more than it was offered tools, many times over.
MAX_MESSAGE_TOOL_CALLS = 128
MAX_TOOL_CALL_ID_CHARS = 256
TOOL_CHOICE_MODES = ("none", "auto", "required")
FUNCTION_NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _check_name(name: str) -> str:
    if not FUNCTION_NAME_PATTERN.fullmatch(name):
        raise ValueError("a function name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    return name


def _check_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    if len(json.dumps(schema)) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the parameters schema must have at most {MAX_GRAMMAR_CHARS} characters as JSON")
    return schema


FunctionName = Annotated[str, AfterValidator(_check_name)]


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: str | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(_check_parameters)] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(StrictModel):
    name: FunctionName
    arguments: str  # JSON text, as OpenAI returns it


class MessageToolCall(StrictModel):
    id: Annotated[str, Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)]
    type: Literal["function"]
    function: CalledFunction

    def to_template(self) -> dict:
        """The call as chat templates take it: arguments as an object where they parse as one."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


MessageToolCalls = Annotated[list[MessageToolCall], Field(max_length=MAX_MESSAGE_TOOL_CALLS)]
ToolCallId = Annotated[str, Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)]


class ToolFields(StrictModel):
    """The tool fields of a chat request; combine before `SamplingFields` (its `constraint` extends theirs)."""

    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_form(cls, value: Any) -> Any:
        """One clear message for both of the union's forms (pydantic's would name a branch)."""
        if value is None or value in TOOL_CHOICE_MODES or isinstance(value, dict):
            return value
        raise ValueError(
            f'must be one of {", ".join(TOOL_CHOICE_MODES)} or {{"type": "function", "function": {{"name": ...}}}}'
        )

    @model_validator(mode="after")
    def _check_tools(self) -> ToolFields:
        names = [t.function.name for t in self.tools or []]
        duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if duplicate is not None:
            raise FieldError(f"`tools` has two functions named `{duplicate}`; names must be unique", "tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError(
                f"`tool_choice` names `{choice.function.name}`, which is not in `tools`", "tool_choice"
            )
        if choice == "required" and not names:
            raise FieldError("`tool_choice` `required` needs `tools`", "tool_choice")
        return self

    @property
    def tools_offered(self) -> list[Tool]:
        """The tools the model is told about: none with `tool_choice: "none"`."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    @property
    def forced_tools(self) -> list[Tool] | None:
        """The tools a forced choice allows (the grammar admits only their calls), or None when the model
        decides (`auto`, OpenAI's default with tools) or has no tools."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools)

    def constraint(self) -> dict[str, str]:
        base = super().constraint()  # type: ignore[misc]
        forced = self.forced_tools
        if forced is None:
            return base
        if base or getattr(self, "response_format", None) is not None and self.response_format.type != "text":
            raise FieldError(
                "a forced `tool_choice` is a constraint of its own: it cannot be combined with "
                "`response_format`, `json_schema`, `regex` or `ebnf`",
                "tool_choice",
            )
        parallel = self.parallel_tool_calls is not False
        return {
            "json_schema": tool_call_schema(
                [(t.function.name, t.function.parameters) for t in forced], parallel
            )
        }
