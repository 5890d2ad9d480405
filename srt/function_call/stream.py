"""`ToolCallStream`: a model's output, in any split, as content text and tool-call deltas (base_parser.py
states the contract). Content is the text outside the blocks with its outer whitespace trimmed."""

from __future__ import annotations

from dataclasses import dataclass, field

from srt.function_call.body_reader import BodyReader, ToolCall, ToolCallDelta


@dataclass
class StreamDelta:
    """What one `feed` (or `finish`) makes certain: content text and call deltas, in output order."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def add(self, other: StreamDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


@dataclass
class ParseResult:
    content: str | None
    calls: list[ToolCall]


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back: it may become one)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _TrimmedContent:
    """Content with leading and trailing whitespace removed, sent as early as that allows: trailing
    whitespace is held until more content follows it."""

    def __init__(self):
        self.started = False
        self.held = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        combined = self.held + text
        sent = combined.rstrip()
        self.held = combined[len(sent) :]
        return sent


class ToolCallStream:
    """Reads blocks between `start_tag` and `end_tag`; with no start tag the whole output is one block (the
    JSON list a `tool_choice` grammar produces)."""

    def __init__(self, tool_names: list[str], start_tag: str | None, end_tag: str | None, list_body: bool):
        self.names = frozenset(tool_names)
        self.start_tag, self.end_tag = start_tag, end_tag
        self.list_body = list_body
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet read: a possible partial tag
        self._content = _TrimmedContent()
        self._block: BodyReader | None = None
        self._block_raw = ""  # the block's text from its start tag, for leaving it as content
        self._num_committed = 0
        self.incomplete_raw: str | None = None  # set by finish(): an unfinished call's text
        if start_tag is None:
            self._open_block("")

    @property
    def num_committed(self) -> int:
        """Calls whose first delta has been sent (including an unfinished one)."""
        return self._num_committed

    def _open_block(self, raw: str) -> None:
        self._block = BodyReader(self.names, self.list_body, self._num_committed)
        self._block_raw = raw

    def _read_block(self, text: str, out: StreamDelta) -> None:
        assert self._block is not None
        self._block.extend(text)
        self._block_raw += text
        deltas = self._block.advance()
        self._num_committed += sum(d.id is not None for d in deltas)
        out.calls.extend(deltas)

    def _close_block(self, out: StreamDelta) -> None:
        block = self._block
        assert block is not None
        self.calls.extend(block.calls)
        if block.incomplete_raw is not None:
            self.incomplete_raw = self._block_raw if not block.calls else block.incomplete_raw
        elif block.next_index == block.first_index:
            out.content += self._content.push(self._block_raw)  # no call in it: it was text after all
        self._block = None

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        buf = self._pending + text
        while buf:
            if self._block is None:
                start = buf.find(self.start_tag)
                if start < 0:
                    keep = _partial_tag_len(buf, self.start_tag)
                    out.content += self._content.push(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep :]
                    break
                out.content += self._content.push(buf[:start])
                buf = buf[start + len(self.start_tag) :]
                self._open_block(self.start_tag)
                continue
            end = buf.find(self.end_tag) if self.end_tag else -1
            if end < 0:
                keep = _partial_tag_len(buf, self.end_tag) if self.end_tag else 0
                self._read_block(buf[: len(buf) - keep], out)
                buf = buf[len(buf) - keep :]
                break
            self._read_block(buf[:end], out)
            self._block_raw += self.end_tag
            self._close_block(out)
            buf = buf[end + len(self.end_tag) :]
        self._pending = buf
        return out

    def finish(self) -> StreamDelta:
        """The end of the output: held-back text is read, an open block is closed."""
        out = StreamDelta()
        if self._block is not None:
            self._read_block(self._pending, out)
            self._close_block(out)
        else:
            out.content += self._content.push(self._pending)
        self._pending = ""
        return out

    def parse_all(self, text: str) -> ParseResult:
        """A whole output at once; an unfinished call is left as content (see base_parser.py)."""
        out = self.feed(text)
        out.add(self.finish())
        content = out.content
        if self.incomplete_raw is not None:
            content += self._content.push(self.incomplete_raw)
        return ParseResult(content if content or not self.calls else None, self.calls)
