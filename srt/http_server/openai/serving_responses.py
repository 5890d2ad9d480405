"""`POST /v1/responses`: OpenAI's Responses API, stateless, as an adapter over the chat route.

A request is translated into the chat request it means (responses_protocol.py) and run by the ChatHandler
itself, so the template, the tool-call parser, the reasoning parser and the grammar judge are the chat
route's. The chat answer (one message, or a stream of deltas) is then re-shaped into Responses' output
items by one `OutputBuilder`: a non-streamed message is fed to it as a single delta, so both forms of the
route make the same items. Items appear in the order the model produced them: `reasoning` (from the chat
message's `reasoning_content` / `reasoning`), the `message` with its `output_text`, one `function_call` per
call. Streamed, each item is announced, filled and closed with the events the `openai` client parses, each
with a `sequence_number`, between `response.created` / `response.in_progress` and `response.completed` (or
`response.incomplete` when `max_output_tokens` cut the answer).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from srt.http_server.openai.errors import validation_error
from srt.http_server.openai.responses_protocol import NamedFunctionChoice, ResponsesRequest
from srt.http_server.openai.serving_chat import ChatHandler

SSE_DATA = "data: "
SSE_DONE_DATA = "[DONE]"
LENGTH_FINISH = "length"


def thinking_delta(delta: dict) -> str | None:
    """The thinking in a chat message or delta, under either name the chat route may use for it."""
    text = delta.get("reasoning_content")
    return delta.get("reasoning") if text is None else text


class OutputBuilder:
    """Turns chat deltas into Responses output items and the stream events that build them. One item is
    open at a time; a delta of another kind (thinking, text, a new call) closes it and opens the next."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # chat's tool-call index -> its function_call item
        self.sequence = 0

    def event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _start(self, item: dict, part: dict | None) -> list[dict]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=json_copy(item)))
        if part is not None:
            events.append(self._part_event("response.content_part.added", item, part))
            item["content"].append(part)
        return events

    def _part_event(self, type_: str, item: dict, part: dict) -> dict:
        index = self.items.index(item)
        return self.event(
            type_, item_id=item["id"], output_index=index, content_index=0, part=json_copy(part)
        )

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if item["type"] == "function_call":
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            done = (
                "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            )
            more = {"logprobs": []} if item["type"] == "message" else {}
            events.append(
                self.event(
                    done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **more
                )
            )
            events.append(self._part_event("response.content_part.done", item, part))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=json_copy(item)))
        return events

    def _open_text(self, kind: str) -> list[dict]:
        """Open a `message` (output_text) or `reasoning` (reasoning_text) item with its one empty part."""
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        return self._start({**item, "status": "in_progress"}, part)

    def _text(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self.open is None or self.open["type"] != kind:
            events = self._open_text(kind)
        item = self.open
        item["content"][0]["text"] += text
        index = len(self.items) - 1
        if kind == "message":
            delta = self.event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        else:
            delta = self.event(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=text,
            )
        return [*events, delta]

    def _call(self, piece: dict) -> list[dict]:
        events: list[dict] = []
        function = piece.get("function") or {}
        index = piece.get("index", len(self.calls))
        if index not in self.calls:
            item = {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "call_id": piece.get("id") or f"call_{uuid.uuid4().hex}",
                "name": function.get("name") or "",
                "arguments": "",
                "status": "in_progress",
            }
            self.calls[index] = item
            events = self._start(item, None)
        item = self.calls[index]
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.items.index(item),
                    delta=arguments,
                )
            )
        return events

    def feed(self, delta: dict) -> list[dict]:
        """The events one chat delta (or a whole non-streamed message) makes."""
        events: list[dict] = []
        thinking = thinking_delta(delta)
        if thinking:
            events += self._text("reasoning", thinking)
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for piece in delta.get("tool_calls") or ():
            events += self._call(piece)
        return events

    def finish(self, incomplete: bool) -> list[dict]:
        """Close the open item: `incomplete` when the answer was cut by `max_output_tokens`. An answer
        with no item at all still gets its (empty) message, as OpenAI's always has one."""
        events = []
        if not self.items:
            events = self._open_text("message")
        return events + self._close("incomplete" if incomplete else "completed")


def json_copy(value: dict) -> dict:
    """A snapshot of an item as it is now (the builder keeps filling the original)."""
    return json.loads(json.dumps(value))


def responses_usage(chat_usage: dict | None) -> dict | None:
    """Chat usage in the Responses shape; reasoning tokens from chat's `completion_tokens_details`."""
    if chat_usage is None:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        # cache_write_tokens: OpenAI's explicit prompt-cache writes, which srt has none of (its prefix cache
        # is implicit); the installed client's type requires the field.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def response_object(
    req: ResponsesRequest,
    rid: str,
    created: int,
    model: str,
    status: str,
    output: list[dict],
    usage: dict | None,
) -> dict:
    """The Response object: the request's settings echoed (as OpenAI does), the output and the usage."""
    if isinstance(req.tool_choice, NamedFunctionChoice):
        tool_choice: str | dict = req.tool_choice.model_dump()
    else:
        tool_choice = req.tool_choice or "auto"
    text_format = (
        req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    )
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": text_format or {"type": "text"}},
        "truncation": "disabled",
        "store": False,
        "background": False,
        "previous_response_id": None,
        "reasoning": None,
        "metadata": req.metadata or {},
        "user": req.user,
        "output": output,
        "usage": usage,
    }


def sse_event(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponsesHandler:
    def __init__(self, chat: ChatHandler):
        self.chat = chat

    async def handle(self, req: ResponsesRequest, request):
        try:
            chat_req = req.to_chat()
        except ValidationError as e:
            return validation_error(RequestValidationError(e.errors())).to_response()
        answer = await self.chat.handle(chat_req, request)
        if answer.status_code != 200:  # the chat route's OpenAI error, which has the same shape here
            return answer
        rid = f"resp_{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.chat.model_name
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(
                self._stream(req, answer.body_iterator, rid, created, model), media_type="text/event-stream"
            )
        body = json.loads(answer.body)
        choice = body["choices"][0]
        message = dict(choice["message"])
        message["tool_calls"] = [{**c, "index": i} for i, c in enumerate(message.get("tool_calls") or ())]
        builder = OutputBuilder()
        incomplete = choice["finish_reason"] == LENGTH_FINISH
        builder.feed(message)
        builder.finish(incomplete)
        status = "incomplete" if incomplete else "completed"
        return JSONResponse(
            response_object(
                req, rid, created, model, status, builder.items, responses_usage(body.get("usage"))
            )
        )

    async def _stream(
        self, req: ResponsesRequest, chunks: AsyncIterator[str], rid: str, created: int, model: str
    ) -> AsyncIterator[str]:
        """The chat stream's chunks re-shaped into Responses events."""
        builder = OutputBuilder()
        start = response_object(req, rid, created, model, "in_progress", [], None)
        yield sse_event(builder.event("response.created", response=start))
        yield sse_event(builder.event("response.in_progress", response=start))
        finish, usage = None, None
        async with aclosing(chunks):
            async for chunk in chunks:
                for line in chunk.splitlines():
                    if not line.startswith(SSE_DATA) or line == SSE_DATA + SSE_DONE_DATA:
                        continue
                    payload = json.loads(line[len(SSE_DATA) :])
                    if "error" in payload:
                        error = payload["error"]
                        fields = {k: error.get(k) for k in ("code", "message", "param")}
                        yield sse_event(builder.event("error", **fields))
                        return
                    usage = payload.get("usage") or usage
                    for choice in payload.get("choices") or ():
                        for event in builder.feed(choice.get("delta") or {}):
                            yield sse_event(event)
                        finish = choice.get("finish_reason") or finish
        incomplete = finish == LENGTH_FINISH
        for event in builder.finish(incomplete):
            yield sse_event(event)
        status = "incomplete" if incomplete else "completed"
        final = response_object(req, rid, created, model, status, builder.items, responses_usage(usage))
        yield sse_event(builder.event(f"response.{status}", response=final))
