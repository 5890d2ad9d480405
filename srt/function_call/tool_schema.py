"""The grammar of a forced `tool_choice` (`"required"` or a named function): a JSON schema for a JSON list of
calls, each `{"name": <an allowed tool>, "arguments": <that tool's parameters schema>}`, at least one, exactly
one when `parallel_tool_calls` is false. It compiles through structured output's `json_schema` kind, so every
grammar backend enforces it; the output is read back by `forced_call_stream` (a tag-less SmolLM2-style list).
"""

from __future__ import annotations

import json

from srt.function_call.stream import ToolCallStream

# A tool given without `parameters` takes no arguments beyond an object (OpenAI's reading).
EMPTY_PARAMETERS = {"type": "object"}


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
DATA_KEYWORDS = ("const", "enum", "default", "examples")


def rebase_refs(schema, base: str):
    """A copy of `schema` whose local `$ref`s ("#", "#/$defs/x") point into `base`, the JSON pointer where it is
    embedded: a tool's parameters schema (pydantic writes `$defs` and `$ref`s) keeps meaning the same inside
    the list-of-calls schema."""
    if isinstance(schema, list):
        return [rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rebase_refs(value, base)
    return out


def tool_call_schema(tools: list[tuple[str, dict | None]], parallel: bool) -> str:
    """`tools`: (name, parameters schema or None) of the tools the model may call."""
    where = "#/items/properties/arguments" if len(tools) == 1 else "#/items/anyOf/{}/properties/arguments"
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": rebase_refs(params, where.format(i)) if params else EMPTY_PARAMETERS,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, (name, params) in enumerate(tools)
    ]
    schema: dict = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema, ensure_ascii=False)


def forced_call_stream(tool_names: list[str]) -> ToolCallStream:
    """The reader of a forced choice's output: the whole output is one JSON list of calls."""
    return ToolCallStream(tool_names, None, None, list_body=True)
