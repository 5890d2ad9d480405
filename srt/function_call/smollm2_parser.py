"""SmolLM2's tool calls (the format its instruct models were tuned on, and the embedded model's): a JSON list
of calls inside one `<tool_call>` block. A single object in the block (the Hermes form) is read too.

    <tool_call>[
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]</tool_call>

SmolLM2-135M-Instruct's own chat template ignores `tools`, so the preamble below offers them in the system
prompt, in the words of SmolLM2's tool-use prompt.
"""

from __future__ import annotations

from srt.function_call.base_parser import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ToolCallParser,
    call_json,
    tools_json_lines,
)


class SmolLM2Parser(ToolCallParser):
    name = "smollm2"
    list_body = True

    def render_preamble(self, tools: list[dict]) -> str:
        return (
            "You are an expert in composing functions. You are given a question and a set of functions.\n"
            "Based on the question, make one or more function calls to achieve its purpose.\n"
            f"You have access to the following tools:\n<tools>{tools_json_lines(tools)}</tools>\n"
            "To call functions, answer with a JSON list of calls inside <tool_call></tool_call> tags:\n"
            f'{TOOL_CALL_START}[\n{{"name": "func_name1", "arguments": {{"argument1": "value1"}}}}\n]{TOOL_CALL_END}'
        )

    def render_calls(self, calls: list[dict]) -> str:
        return f"{TOOL_CALL_START}[\n" + ",\n".join(call_json(c) for c in calls) + f"\n]{TOOL_CALL_END}"
