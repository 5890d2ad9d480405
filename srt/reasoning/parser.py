"""Reasoning formats: the thinking a model writes before its answer, told apart from the answer.

A reasoning model wraps its thinking in a start and an end tag (`<think>` … `</think>`). `--reasoning-parser
NAME` picks the format (SGLang's names); each request's output is then read by a `ReasoningStream`, which
splits it into the reasoning and the content (the answer) as it arrives. The contract, as for the tool-call
streams (`srt/function_call/stream.py`):

- `feed(text)` takes the output in any split and returns the (reasoning, content) that may be sent now;
  `finish()` flushes the rest. Splitting the text differently never changes what is read (tests feed every
  cut position): text that may be the start of a tag is held back until it is known not to be one.
- Whitespace the template puts around the tags (the newline after `<think>`, before `</think>`, and between
  `</think>` and the answer) belongs to neither part.
- A format whose opening tag the chat template writes into the prompt (DeepSeek-R1's) starts in reasoning;
  one the model may open itself starts in content, and its thinking begins only if the output begins with
  the opening tag (after whitespace). In both, an opening tag at the very start of the output is read, never
  shown.
- Output that ends inside the reasoning (`max_tokens` cut it) is reasoning, and the content is empty.
- `reasoning_ended` says when the answer may begin: what reads only the answer (stop strings, grammars, tool
  calls) starts there.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
# The names clients read the thinking under: SGLang's and DeepSeek's, and vLLM's (OpenAI's guidance for
# gpt-oss; vLLM dropped the other in 2026). `--reasoning-field` answers with both or one.
REASONING_CONTENT, REASONING = "reasoning_content", "reasoning"
REASONING_FIELD_BOTH = "both"
REASONING_FIELDS = (REASONING_FIELD_BOTH, REASONING_CONTENT, REASONING)


@dataclass(frozen=True)
class ReasoningFormat:
    """One family's reasoning tags; `starts_in_reasoning` when its chat template opens the thinking in the
    prompt, so the output begins inside it."""

    name: str
    start_tag: str = THINK_START
    end_tag: str = THINK_END
    starts_in_reasoning: bool = False

    def new_stream(self, thinking: bool = True) -> ReasoningStream:
        """A reader for one request's output; `thinking=False` when the request turned thinking off (its
        output is then all answer, though a format that starts in reasoning still skips a closed empty block)."""
        return ReasoningStream(self, thinking)

    def parse(self, text: str, thinking: bool = True) -> tuple[str, str]:
        """(reasoning, content) of a whole output: its stream fed all of it at once."""
        stream = self.new_stream(thinking)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return r1 + r2, c1 + c2


# SGLang's --reasoning-parser names. Qwen3 opens the thinking itself (its template writes an empty, closed
# block into the prompt when `enable_thinking` is false); DeepSeek-R1's template ends the prompt with `<think>`.
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat("qwen3"),
        ReasoningFormat("qwen3-thinking", starts_in_reasoning=True),
        ReasoningFormat("deepseek-r1", starts_in_reasoning=True),
    )
}

# the states of a stream
_OPENING, _REASONING, _ANSWER_START, _ANSWER = range(4)


def _held_tag_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the beginning of `tag` (held back until known)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """The incremental reader of one request's output (see the module docstring for the contract)."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool = True):
        self.fmt = fmt
        self._forced = fmt.starts_in_reasoning and thinking
        # thinking turned off in a format the model opens itself: the output is all answer
        self._state = _OPENING if thinking or fmt.starts_in_reasoning else _ANSWER
        self._buf = ""  # text not yet given out
        self._reasoning_started = False  # whitespace after the opening tag is skipped until then

    @property
    def reasoning_ended(self) -> bool:
        """True once the answer may begin (the end tag was read, or the output never opened a thinking)."""
        return self._state in (_ANSWER_START, _ANSWER)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while True:
            progressed = self._step(reasoning, content, final=False)
            if not progressed:
                return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        reasoning, content = [], []
        while self._step(reasoning, content, final=True):
            pass
        return "".join(reasoning), "".join(content)

    def _step(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        """Consume what can be decided from the buffer; False when nothing more can be now."""
        buf = self._buf
        if not buf:
            return False
        if self._state == _OPENING:
            stripped = buf.lstrip()
            tag = self.fmt.start_tag
            if stripped.startswith(tag):
                self._buf, self._state = stripped[len(tag) :], _REASONING
                return True
            if (not stripped or tag.startswith(stripped)) and not final:
                return False  # whitespace or the start of the tag: wait
            # no opening tag: a forced format is thinking already, another one is answering
            self._state = _REASONING if self._forced else _ANSWER
            return True
        if self._state == _REASONING:
            if not self._reasoning_started:
                stripped = buf.lstrip()
                if not stripped:
                    if final:
                        self._buf = ""
                    return False
                self._buf = buf = stripped
                self._reasoning_started = True
            end = buf.find(self.fmt.end_tag)
            if end >= 0:
                reasoning.append(buf[:end].rstrip())
                self._buf, self._state = buf[end + len(self.fmt.end_tag) :], _ANSWER_START
                return True
            if final:  # cut inside the thinking: all of it is reasoning
                reasoning.append(buf.rstrip())
                self._buf = ""
                return False
            body = buf[: len(buf) - _held_tag_prefix(buf, self.fmt.end_tag)]
            sendable = body.rstrip()  # trailing whitespace may precede the end tag: held until text follows
            reasoning.append(sendable)
            self._buf = buf[len(sendable) :]
            return False
        if self._state == _ANSWER_START:
            stripped = buf.lstrip()
            if not stripped:
                if final:
                    self._buf = ""
                return False
            self._buf, self._state = stripped, _ANSWER
            return True
        content.append(buf)
        self._buf = ""
        return False
