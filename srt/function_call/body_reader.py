"""Reading calls out of a growing tool-call block body, as soon as each piece is certain.

A body is one JSON object `{"name": ..., "arguments": {...}}` or (`list_body`) a JSON list of them. A call is
committed (its id and name sent) as soon as `{"name": "<a tool>", "arguments": {` has been read — the order
models write — and its arguments are then sent as raw text while they grow; the call is complete when the
arguments object closes. An object in any other key order is read once it is complete, and its arguments
are sent re-serialised. Either way the arguments text is the same however the body was split.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

# `{"name": "<json string>", "arguments": ` followed by the arguments object's `{` (not consumed, so the
# match cannot grow as more text arrives). "parameters" is accepted as the arguments' key (Llama's usage).
_ORDERED_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
_DECODER = json.JSONDecoder()
_ARGUMENT_KEYS = ("arguments", "parameters")
CALL_ID_HEX_CHARS = 24


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:CALL_ID_HEX_CHARS]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallDelta:
    """A piece of call `index`: its first delta carries `id` and `name`, later ones arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        function: dict = {"arguments": self.arguments}
        delta: dict = {"index": self.index, "function": function}
        if self.id is not None:
            delta.update(id=self.id, type="function")
            function["name"] = self.name
        return delta


def _decode(text: str, pos: int):
    """(value, end) of the JSON value at `pos`, or None while it is incomplete (or invalid)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


class BodyReader:
    """One block's body; `extend` adds text, `advance` returns the deltas that became certain."""

    # States: where the next unread character of the body belongs.
    START, ITEM, OBJECT, OBJECT_TAIL, AFTER_OBJECT, DONE, BAD = range(7)

    def __init__(self, tool_names: frozenset[str], list_body: bool, first_index: int):
        self.names = tool_names
        self.list_body = list_body
        self.first_index = self.next_index = first_index
        self.text = ""
        self.pos = 0
        self.state = self.START
        self.calls: list[ToolCall] = []
        self.open: ToolCall | None = None  # committed, arguments still growing
        self._args_start = 0

    @property
    def incomplete_raw(self) -> str | None:
        """The raw text of a committed call whose arguments never closed, else None."""
        return self.text[self.pos :] if self.open is not None else None

    def extend(self, text: str) -> None:
        self.text += text

    def advance(self) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[ToolCallDelta]) -> bool:
        """Move past one certain piece; False when more text is needed (or the body is done or bad)."""
        text, state = self.text, self.state
        if state in (self.START, self.ITEM, self.AFTER_OBJECT):
            self.pos = _skip_ws(text, self.pos)
            if self.pos >= len(text):
                return False
            c = text[self.pos]
            if state == self.START and c == "[" and self.list_body:
                self.pos, self.state = self.pos + 1, self.ITEM
            elif state in (self.START, self.ITEM) and c == "{":
                self.state = self.OBJECT
            elif (
                state == self.ITEM and c == "]" or state == self.AFTER_OBJECT and c == "]" and self.list_body
            ):
                self.pos, self.state = self.pos + 1, self.DONE
            elif state == self.AFTER_OBJECT and c == "," and self.list_body:
                self.pos, self.state = self.pos + 1, self.ITEM
            else:
                self.state = self.BAD
            return self.state not in (self.DONE, self.BAD)
        if state == self.OBJECT:
            return self._object(out) if self.open is None else self._arguments(out)
        if state == self.OBJECT_TAIL:
            decoded = _decode(text, self.pos)
            if decoded is None:
                return False
            self.pos = decoded[1]
            self.state = self.AFTER_OBJECT if self.list_body else self.DONE
            return True
        return False

    def _commit(self, name: str, out: list[ToolCallDelta]) -> ToolCall:
        call = ToolCall(name, "")
        out.append(ToolCallDelta(self.next_index, call.id, name))
        self.next_index += 1
        return call

    def _object(self, out: list[ToolCallDelta]) -> bool:
        head = _ORDERED_HEAD.match(self.text, self.pos)
        if head is not None:
            name = json.loads(head.group(1))
            if name in self.names:
                self.open = self._commit(name, out)
                self._args_start = head.end()
                return True
        decoded = _decode(self.text, self.pos)
        if decoded is None:
            return False
        obj, end = decoded
        self.pos = end
        self.state = self.AFTER_OBJECT if self.list_body else self.DONE
        arguments = (
            next((obj[k] for k in _ARGUMENT_KEYS if k in obj), None) if isinstance(obj, dict) else None
        )
        if isinstance(arguments, dict) and obj.get("name") in self.names:
            call = self._commit(obj["name"], out)
            call.arguments = json.dumps(arguments, ensure_ascii=False)
            out.append(ToolCallDelta(out[-1].index, arguments=call.arguments))
            self.calls.append(call)
        elif not self.list_body:
            self.state = self.BAD  # the block's one object is not a call of this request
        return True

    def _arguments(self, out: list[ToolCallDelta]) -> bool:
        call = self.open
        assert call is not None
        index = self.next_index - 1
        decoded = _decode(self.text, self._args_start)
        end = decoded[1] if decoded is not None else len(self.text)
        piece = self.text[self._args_start + len(call.arguments) : end]
        if piece:
            out.append(ToolCallDelta(index, arguments=piece))
            call.arguments += piece
        if decoded is None:
            return False
        self.calls.append(call)
        self.open = None
        self.state = self.OBJECT_TAIL
        return True
