"""Tools in a chat request: the prompt that offers them and the reading of the model's calls.

The chat template gets the tools when it renders them itself; otherwise (SmolLM2's template ignores them) the
server's tool-call format writes them into the system prompt and the history's calls and results into plain
turns. With `tool_choice` `auto` the output is read with the server's `--tool-call-parser`; a forced choice
(`required`, named) was constrained by a grammar to a JSON list of calls, read by `forced_call_stream`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.function_call import ToolCallParser, ToolCallStream
from srt.function_call.tool_schema import forced_call_stream
from srt.http_server.openai.protocol import ChatCompletionRequest
from srt.reasoning.parser import REASONING, REASONING_CONTENT

if TYPE_CHECKING:
    from srt.http_server.tokenize_protocol import TokenizeRequest

FINISH_TOOL_CALLS = "tool_calls"


def template_message(m) -> dict:
    """A request message as chat templates take it (Hugging Face's tool-use message shapes). An assistant
    turn's thinking goes under both names templates read it by (Qwen3's reads `reasoning_content`; others
    `reasoning`), whichever the client sent it under; a template that reads neither drops it, as it does on
    SGLang and vLLM, which pass the message through the same way (docs/reasoning.md)."""
    out: dict = {"role": m.role, "content": m.text()}
    thinking = m.thinking()
    if thinking is not None:
        out[REASONING_CONTENT] = out[REASONING] = thinking
    if m.tool_calls:
        out["tool_calls"] = [c.to_template() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


class ChatTools:
    """One request's view of tools: the prompt messages, and a reader per choice when calls are expected."""

    def __init__(self, req: ChatCompletionRequest | TokenizeRequest, parser: ToolCallParser):
        """`req`: a chat request, or a `/tokenize` one (the same `messages` and tool fields)."""
        self.req = req
        self.parser = parser
        self.offered = [t.model_dump(exclude_none=True) for t in req.tools_offered]
        forced = req.forced_tools
        self.forced = forced is not None
        self.names = [t.function.name for t in (forced if forced is not None else req.tools_offered)]

    @property
    def reads_calls(self) -> bool:
        return bool(self.names)

    def prompt(self, template_takes_tools: bool) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools for the template): the template's own rendering when it has one."""
        messages = [template_message(m) for m in self.req.messages]
        if template_takes_tools:
            return messages, self.offered or None
        return self.parser.render_messages(messages, self.offered), None

    def new_stream(self) -> ToolCallStream | None:
        if not self.reads_calls:
            return None
        return forced_call_stream(self.names) if self.forced else self.parser.new_stream(self.names)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The choice's `message` and its finish reason: `tool_calls` when the model called tools."""
        stream = self.new_stream()
        if stream is None:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = stream.parse_all(text)
        message: dict = {"role": "assistant", "content": parsed.content}
        if not parsed.calls:
            return message, finish_reason
        message["tool_calls"] = [c.to_openai() for c in parsed.calls]
        return message, finish_override(finish_reason)


def finish_override(finish_reason: str | None) -> str | None:
    """OpenAI's finish reason of a choice that called tools: `tool_calls` where the model stopped itself."""
    return FINISH_TOOL_CALLS if finish_reason == "stop" else finish_reason
