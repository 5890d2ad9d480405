"""The tool-call parser interface: one model family's tool-call format, read back and written out.

A format wraps calls in a start and an end tag (`<tool_call>` … `</tool_call>`); inside a block is one JSON
object `{"name": ..., "arguments": {...}}` or, where the format allows, a JSON list of them. The contract:

- `new_stream(tool_names)` returns an incremental reader (`ToolCallStream`): `feed(text)` takes the model's
  output in any split and returns what may be sent now; `finish()` flushes the rest. Splitting the text
  differently never changes what is read (tests feed random splits). Text that may be the start of a tag is
  held back until it is known not to be one.
- `parse(text, tool_names)` reads a whole completion: the calls, and the text outside them as content.
  It is the stream fed the whole text at once, except that a call the model left unfinished (cut off by
  `max_tokens`) is left as content here, while a stream has already sent it as far as it went.
- A block that is not valid JSON of the format's shape, or that names no tool of the request, is left as
  content, never an error. A list's entries naming unknown tools are dropped.
- `render_preamble(tools)` and `render_calls(calls)` write the format into a prompt, for chat templates that
  ignore `tools` (`render_messages` applies both to a conversation).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from srt.function_call.stream import ParseResult, ToolCallStream
from srt.reasoning.parser import REASONING, REASONING_CONTENT

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"


class ToolCallParser(ABC):
    """A tool-call format (see the module docstring for the contract)."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = TOOL_CALL_START
    end_tag: ClassVar[str] = TOOL_CALL_END
    # True when one block may hold a JSON list of calls.
    list_body: ClassVar[bool] = False

    def new_stream(self, tool_names: list[str]) -> ToolCallStream:
        return ToolCallStream(tool_names, self.start_tag, self.end_tag, self.list_body)

    def parse(self, text: str, tool_names: list[str]) -> ParseResult:
        return self.new_stream(tool_names).parse_all(text)

    @abstractmethod
    def render_preamble(self, tools: list[dict]) -> str:
        """System-prompt text that offers `tools` (OpenAI tool objects) and shows the call format."""

    @abstractmethod
    def render_calls(self, calls: list[dict]) -> str:
        """An assistant turn's calls (`{"name", "arguments"}` with arguments as a dict) in the format."""

    def render_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """`messages` (OpenAI roles, assistant `tool_calls`, `tool` results) as plain-text messages any chat
        template renders: the preamble joins the first system message (or becomes one), calls become the
        assistant's text, and tool results become user turns wrapped in `<tool_response>` tags. An assistant
        turn keeps its thinking (`reasoning_content`, `reasoning`) for the template to read."""
        out = []
        for m in messages:
            content = m.get("content") or ""
            if m["role"] == "assistant":
                if m.get("tool_calls"):
                    calls = [c["function"] for c in m["tool_calls"]]
                    content = "\n".join(filter(None, [content, self.render_calls(calls)]))
                thinking = {k: m[k] for k in (REASONING_CONTENT, REASONING) if k in m}
                out.append({"role": "assistant", "content": content, **thinking})
            elif m["role"] == "tool":
                out.append(
                    {"role": "user", "content": f"{TOOL_RESPONSE_START}\n{content}\n{TOOL_RESPONSE_END}"}
                )
            else:
                out.append({"role": m["role"], "content": content})
        if tools:
            preamble = self.render_preamble(tools)
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{preamble}".lstrip()}
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return out


def tools_json_lines(tools: list[dict]) -> str:
    """One compact JSON line per tool, as the preambles list them."""
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def call_json(call: dict[str, Any]) -> str:
    return json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
