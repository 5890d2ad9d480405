"""Hermes / Qwen 2.5 / Qwen 3 tool calls: one JSON object per `<tool_call>` block, blocks one after another.

<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
"""

from __future__ import annotations

from srt.function_call.base_parser import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ToolCallParser,
    call_json,
    tools_json_lines,
)


class HermesParser(ToolCallParser):
    name = "hermes"

    def render_preamble(self, tools: list[dict]) -> str:
        return (
            "# Tools\n\n"
            "You may call one or more of the functions below to help with the user's request.\n"
            "Their signatures are listed inside <tools></tools> tags:\n"
            f"<tools>\n{tools_json_lines(tools)}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside "
            "<tool_call></tool_call> tags, one block per call:\n"
            f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{TOOL_CALL_END}'
        )

    def render_calls(self, calls: list[dict]) -> str:
        return "\n".join(f"{TOOL_CALL_START}\n{call_json(c)}\n{TOOL_CALL_END}" for c in calls)
