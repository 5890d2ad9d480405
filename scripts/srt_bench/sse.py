"""Incremental Server-Sent Events decoding, and turning each backend's stream payloads into output deltas.

The decoder works on raw byte chunks as the network delivers them, because a TCP read may end in the middle
of an event (or of a UTF-8 sequence): an event is complete only at its blank line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DONE_SENTINEL = "[DONE]"


class SSEDecoder:
    """Feed bytes, get the `data` payload of every completed event (multi-line data joined by newlines).

    Comment lines (`:` ...) and other fields (`event`, `id`, `retry`) are ignored: OpenAI-style servers
    put everything in `data`."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        payloads: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                break
            raw, self._buffer = self._buffer[:newline], self._buffer[newline + 1 :]
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:
                if self._data_lines:
                    payloads.append("\n".join(self._data_lines))
                    self._data_lines = []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if name == "data":
                self._data_lines.append(value[1:] if value.startswith(" ") else value)
        return payloads

    def flush(self) -> list[str]:
        """Payload of a last event the server did not terminate with a blank line."""
        tail = self.feed(b"\n\n") if self._buffer or self._data_lines else []
        return tail


@dataclass
class StreamDelta:
    """What one payload told us: new output text, how many new tokens (when the server says), token counts
    from a usage block, and whether the stream is over."""

    text: str = ""
    new_tokens: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False
    error: str = ""

    @property
    def has_output(self) -> bool:
        return bool(self.text) or bool(self.new_tokens)


def _usage_delta(obj: dict, delta: StreamDelta) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        delta.prompt_tokens = usage.get("prompt_tokens")
        delta.completion_tokens = usage.get("completion_tokens")


def parse_openai_payload(payload: str, chat: bool) -> StreamDelta:
    """One `data:` payload of /v1/chat/completions or /v1/completions with `stream: true`."""
    if payload.strip() == DONE_SENTINEL:
        return StreamDelta(done=True)
    obj = json.loads(payload)
    delta = StreamDelta()
    if "error" in obj:
        err = obj["error"]
        delta.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return delta
    for choice in obj.get("choices") or []:
        if chat:
            delta.text += (choice.get("delta") or {}).get("content") or ""
        else:
            delta.text += choice.get("text") or ""
    _usage_delta(obj, delta)
    return delta


class GenerateStreamParser:
    """Payloads of srt's native `/generate` with `stream: true` (SGLang's shape): each carries the text so far
    (cumulative) and `meta_info.completion_tokens`; an incremental server sends only the new text, which is
    detected because it does not extend what came before."""

    def __init__(self) -> None:
        self._text = ""
        self._tokens = 0

    def parse(self, payload: str) -> StreamDelta:
        if payload.strip() == DONE_SENTINEL:
            return StreamDelta(done=True)
        obj = json.loads(payload)
        if "error" in obj:
            err = obj["error"]
            return StreamDelta(error=err.get("message", str(err)) if isinstance(err, dict) else str(err))
        text = obj.get("text") or ""
        new_text = text[len(self._text) :] if text.startswith(self._text) else text
        self._text = text if text.startswith(self._text) else self._text + text
        meta = obj.get("meta_info") or {}
        delta = StreamDelta(text=new_text, prompt_tokens=meta.get("prompt_tokens"))
        completion = meta.get("completion_tokens")
        if completion is not None:
            delta.new_tokens = completion - self._tokens
            delta.completion_tokens = completion
            self._tokens = completion
        return delta
