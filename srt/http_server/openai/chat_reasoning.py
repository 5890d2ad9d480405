"""A chat choice's output read as thinking and answer, and the answer as content and tool calls.

On a `--reasoning-parser` server each choice's text goes through the reasoning reader first
(`srt/reasoning/parser.py`); only its content, the answer, reaches the tool-call reader, so a call written while
thinking is never parsed as one. A request with `separate_reasoning: false` reads its output raw, as a server
without a parser does. `reasoning_tokens` counts the thinking by token for OpenAI's
`usage.completion_tokens_details.reasoning_tokens` (docs/reasoning.md, "Counting").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from srt.function_call import StreamDelta, ToolCallStream
from srt.reasoning.parser import (
    REASONING,
    REASONING_CONTENT,
    REASONING_FIELD_BOTH,
    REASONING_FORMATS,
    ReasoningFormat,
    ReasoningStream,
)


@dataclass(frozen=True)
class ReasoningReading:
    """How one server reads its outputs' thinking: its format, the field(s) chat answers in, the end tag's
    token id when the tag is one token of the vocabulary (None: counted by decoded prefixes), and the
    tokenizer that decodes them."""

    fmt: ReasoningFormat
    field: str
    end_token_id: int | None
    tokenizer: object = field(compare=False, repr=False)

    @classmethod
    def for_server(cls, parser: str | None, field: str, tokenizer) -> ReasoningReading | None:
        if parser is None:
            return None
        fmt = REASONING_FORMATS[parser]
        ids = tokenizer.encode(fmt.end_tag, add_special_tokens=False)
        return cls(fmt, field, ids[0] if len(ids) == 1 else None, tokenizer)

    def fields(self, reasoning: str) -> dict:
        """The thinking under the name(s) `--reasoning-field` chose; null when there was none (SGLang's)."""
        names = (REASONING_CONTENT, REASONING) if self.field == REASONING_FIELD_BOTH else (self.field,)
        return dict.fromkeys(names, reasoning or None)

    def reasoning_tokens(self, text: str, output_ids: list[int], thinking: bool) -> int:
        """Output tokens up to and including the end tag; all of them when the output ended inside the
        thinking (`max_tokens` cut it); none when it never thought. By the end tag's id when it is one token
        the model wrote, else by the decoded text of the output's prefixes."""
        if not thinking and not self.fmt.starts_in_reasoning:
            return 0  # read as all answer
        stream = self.fmt.new_stream(thinking)
        stream.feed(text)
        stream.finish()
        # cut inside the thinking (or an empty output of a format that opens none: no thinking)
        if not stream.reasoning_ended:
            return len(output_ids) if text.strip() or (self.fmt.starts_in_reasoning and thinking) else 0
        if self.end_token_id is not None and self.end_token_id in output_ids:
            return output_ids.index(self.end_token_id) + 1
        if self.fmt.end_tag not in text:
            return 0
        return self._tokens_through_tag(output_ids)

    def _tokens_through_tag(self, output_ids: list[int]) -> int:
        """The fewest output tokens whose text holds the end tag (a tag of several tokens, or one the model
        spelled in pieces): a binary search over prefixes, since a longer prefix's text extends a shorter
        one's."""
        lo, hi = 1, len(output_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.fmt.end_tag in self.tokenizer.decode(output_ids[:mid], skip_special_tokens=False):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def split(self, text: str, thinking: bool) -> tuple[str, str]:
        """(reasoning, answer) of a whole output."""
        return self.fmt.parse(text, thinking)


class ReasoningTracker:
    """The request metrics recorder's reading of one request's output as it arrives: when the first answer
    text came (time to first answer token) and, at finish, its reasoning tokens. The recorder owns it (in the
    request's TokenStamps), so the counter, the histogram and the response's usage read one record."""

    def __init__(self, reading: ReasoningReading, thinking: bool):
        self.reading, self.thinking = reading, thinking
        self._stream = reading.fmt.new_stream(thinking)
        self._text = ""
        self._ids: list[int] = []
        self.first_answer_ts: float | None = None

    def feed(self, text: str, ids: list[int], now: float) -> None:
        self._text += text
        self._ids.extend(ids)
        if self.first_answer_ts is None and self._stream.feed(text)[1]:
            self.first_answer_ts = now

    def finish(self, now: float) -> int:
        """The output's reasoning tokens (its last piece was fed)."""
        if self.first_answer_ts is None and self._stream.finish()[1]:
            self.first_answer_ts = now
        return self.reading.reasoning_tokens(self._text, self._ids, self.thinking)


class ChoiceReader:
    """One choice's output in any split: (reasoning, content and tool-call deltas) per feed. Either reader may
    be absent: no parser (or `separate_reasoning: false`), or no tools offered."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None):
        self.reasoning = reasoning
        self.tools = tools

    @property
    def num_committed(self) -> int:
        return self.tools.num_committed if self.tools is not None else 0

    def _answer(self, content: str, final: bool) -> StreamDelta:
        if self.tools is None:
            return StreamDelta(content)
        out = self.tools.feed(content)
        if final:
            out.add(self.tools.finish())
        return out

    def feed(self, text: str, final: bool = False) -> tuple[str, StreamDelta]:
        """What `text` makes certain; `final` with the output's last piece flushes both readers."""
        if self.reasoning is None:
            return "", self._answer(text, final)
        reasoning, content = self.reasoning.feed(text)
        if final:
            r, c = self.reasoning.finish()
            reasoning, content = reasoning + r, content + c
        return reasoning, self._answer(content, final)
