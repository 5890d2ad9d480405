"""`/tokenize` and `/detokenize`: the ids the generation routes would prefill for a text or a chat, and back.

A chat is rendered exactly as `/v1/chat/completions` renders it (the same template call, the same handling
of `tools`), so `count` equals that route's `usage.prompt_tokens` for the same messages; a prompt is
tokenized as `/v1/completions` tokenizes it. Answers carry `max_model_len`, so a client can see whether the
text fits.

Both routes keep the generation routes' size limits, so neither can be made to do (or send) much more work
than a generation request: all of a request's texts together are refused by size before any is tokenized,
`/detokenize` takes at most the context's length of ids and answers at most the text `/tokenize` would take
back. Large answers are built on a worker thread, not on the event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from fastapi.responses import Response

from srt.function_call import ToolCallParser
from srt.http_server.input_processor import MAX_CHARS_PER_TOKEN, InvalidRequestError
from srt.http_server.openai.chat_tools import ChatTools
from srt.http_server.openai.serving_common import resolve_model, to_openai_error
from srt.http_server.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from srt.http_server.tokenizer_manager import TokenizerManager

# Answers with more ids than this are built (token strings, JSON) on a worker thread: a text within the
# limit can tokenize to ~800,000 ids (3 a character for emoji), whose answer took FastAPI's encoder 2.2 s.
# Smaller ones take about a millisecond, less than the hand-off.
INLINE_ANSWER_IDS = 4096
# json.dumps holds the GIL for a whole call (0.2 s for those 800,000 ids and their strings): long lists are
# written in pieces of this many items, so the event loop gets the GIL between two (a few milliseconds).
JSON_PIECE_ITEMS = 16384


def _dumps(value) -> str:
    """Starlette's JSONResponse text of `value` (plain dicts, lists, strings and numbers), long lists written
    piece by piece; FastAPI's own encoder is 10x slower on long id lists."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{_dumps(k)}:{_dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "[" + ",".join(map(_dumps, value)) + "]"
    if isinstance(value, list) and len(value) > JSON_PIECE_ITEMS:
        pieces = range(0, len(value), JSON_PIECE_ITEMS)
        return "[" + ",".join(_dumps(value[i : i + JSON_PIECE_ITEMS])[1:-1] for i in pieces) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class TokenizeHandler:
    def __init__(self, tm: TokenizerManager, model_name: str, tool_parser: ToolCallParser):
        self.tm = tm
        self.model_name = model_name
        self.tool_parser = tool_parser

    async def _chat_ids(self, req: TokenizeRequest) -> list[int]:
        messages, tools = ChatTools(req, self.tool_parser).prompt(self.tm.inputs.template_takes_tools)
        return await self.tm.inputs.apply_chat_template(
            messages, tools, req.add_generation_prompt, add_special_tokens=bool(req.add_special_tokens)
        )

    async def _prompt_ids(self, req: TokenizeRequest) -> list[list[int]]:
        texts = req.prompt if req.batched else [req.prompt]
        # All the texts together, as the generation routes count a request's prompts: each text alone within
        # the limit would let one request tokenize (and answer) MAX_PROMPTS times as much.
        self.tm.inputs.check_input_chars(sum(map(len, texts)), "prompt")
        special = req.add_special_tokens is not False
        return [await self.tm.inputs.encode(t, add_special_tokens=special) for t in texts]

    def _answer(self, answers: list[list[int]], batched: bool, token_strs: bool) -> dict:
        """vLLM's fields for one text; SGLang's batch shape for a list of texts (each field a list)."""
        fields: dict = {"count": [len(ids) for ids in answers], "tokens": answers}
        if token_strs:
            fields["token_strs"] = [self.tm.inputs.token_strings(ids) for ids in answers]
        if not batched:
            fields = {key: value[0] for key, value in fields.items()}
        return fields | {"max_model_len": self.tm.context_len}

    async def _respond(self, build: Callable[[], dict], num_ids: int) -> Response:
        """`build()`'s answer as JSON, built on a worker thread when it holds many ids: there the event loop
        gets the GIL back every few milliseconds and keeps serving everyone else."""

        def render() -> bytes:
            return _dumps(build()).encode()

        if num_ids <= INLINE_ANSWER_IDS:
            body = render()
        else:
            body = await asyncio.get_running_loop().run_in_executor(None, render)
        return Response(body, media_type="application/json")

    async def tokenize(self, req: TokenizeRequest):
        try:
            resolve_model(self.tm, req.model, self.model_name)
            if req.messages is not None:
                answers = [await self._chat_ids(req)]
            else:
                answers = await self._prompt_ids(req)
        except Exception as e:
            return to_openai_error(e).to_response()
        return await self._respond(
            lambda: self._answer(answers, req.batched, req.return_token_strs), sum(map(len, answers))
        )

    def _check_id_count(self, ids: list[int]) -> None:
        """At most the context length of ids: no sequence this model reads or writes is longer, and the
        bound keeps the answer's size (and the decoding) in proportion to a generation request's."""
        if len(ids) > self.tm.context_len:
            raise InvalidRequestError(
                f"{len(ids)} token ids are more than the model's context length of {self.tm.context_len} "
                "(`max_model_len`)",
                "tokens",
            )

    def _check_text_size(self, text: str) -> None:
        """The text must be one `/tokenize` takes back: long tokens (80 characters for some) repeated would
        otherwise answer ~80 characters per id sent."""
        limit = self.tm.inputs.max_input_chars
        if len(text) > limit:
            raise InvalidRequestError(
                f"these token ids decode to {len(text)} characters; this server answers at most {limit} "
                f"({MAX_CHARS_PER_TOKEN} per token of its {self.tm.context_len}-token context), the most a "
                "request's text may have",
                "tokens",
            )

    async def detokenize(self, req: DetokenizeRequest):
        try:
            resolve_model(self.tm, req.model, self.model_name)
            self._check_id_count(req.tokens)
            text = await self.tm.inputs.decode(req.tokens)  # off the event loop when long
            self._check_text_size(text)
        except Exception as e:
            return to_openai_error(e).to_response()
        return await self._respond(
            lambda: {"prompt": text, "text": text}, len(req.tokens)
        )  # vLLM's, SGLang's
