"""Tool calls: reading a model's tool-call output into OpenAI `tool_calls`, and writing tools into prompts.

One module per format, each a `ToolCallParser` (base_parser.py states the contract), chosen with
`--tool-call-parser` from the registry below; `tool_schema.py` builds the grammar that enforces a forced
`tool_choice`.
"""

from __future__ import annotations

from srt.function_call.base_parser import ToolCallParser
from srt.function_call.body_reader import ToolCall, ToolCallDelta
from srt.function_call.hermes_parser import HermesParser
from srt.function_call.smollm2_parser import SmolLM2Parser
from srt.function_call.stream import ParseResult, StreamDelta, ToolCallStream

# --tool-call-parser name -> format. SGLang's names: `qwen25` and `qwen` are the Hermes format.
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "smollm2": SmolLM2Parser,
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen": HermesParser,
}
# The embedded model's format; it also reads Hermes' single-object blocks.
DEFAULT_TOOL_CALL_PARSER = "smollm2"


def create_tool_call_parser(name: str) -> ToolCallParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()


__all__ = [
    "DEFAULT_TOOL_CALL_PARSER",
    "TOOL_CALL_PARSERS",
    "ParseResult",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStream",
    "create_tool_call_parser",
]
