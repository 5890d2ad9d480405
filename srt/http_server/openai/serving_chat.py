"""`POST /v1/chat/completions`: chat template, sampling, and OpenAI's response and chunk shapes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from srt.constrained import constraint_key
from srt.function_call import DEFAULT_TOOL_CALL_PARSER, StreamDelta, create_tool_call_parser
from srt.http_server.input_processor import GenerateInput
from srt.http_server.openai.chat_reasoning import ChoiceReader, ReasoningReading
from srt.http_server.openai.chat_tools import ChatTools, finish_override
from srt.http_server.openai.protocol import ChatCompletionRequest
from srt.http_server.openai.response_frame import ResponseFrame
from srt.http_server.openai.serving_common import (
    ChoiceAcc,
    collect_response,
    resolve_model,
    stream_with_errors,
    to_openai_error,
    token_text,
)
from srt.http_server.output_dispatch import ReqOutput
from srt.http_server.tokenizer_manager import TokenizerManager
from srt.metrics.request_stats import FinishedRequestStats


def stream_delta(read: StreamDelta, reasoning: dict | None = None) -> dict:
    """A chunk's delta from what the readers made certain: thinking, content, then call pieces."""
    delta: dict = dict(reasoning or {})
    if read.content:
        delta["content"] = read.content
    if read.calls:
        delta["tool_calls"] = [d.to_openai() for d in read.calls]
    return delta


def _logprob_entry(tm: TokenizerManager, token_id: int, logprob: float) -> dict:
    text = token_text(tm, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    tm: TokenizerManager,
    ids: list[int],
    logprobs: list[float] | None,
    tops: list[list[tuple[int, float]]] | None,
) -> dict | None:
    """OpenAI's chat `logprobs.content`: one entry per output token with its top alternatives."""
    if not logprobs:
        return None
    content = []
    for k, (token_id, lp) in enumerate(zip(ids, logprobs, strict=False)):
        entry = _logprob_entry(tm, token_id, lp)
        top = tops[k] if tops and k < len(tops) else []
        entry["top_logprobs"] = [_logprob_entry(tm, t, v) for t, v in top]
        content.append(entry)
    return {"content": content}


class ChatHandler:
    def __init__(
        self, tm: TokenizerManager, model_name: str, tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER
    ):
        self.tm = tm
        self.model_name = model_name
        self.tool_parser = create_tool_call_parser(tool_call_parser)
        args = tm.server_args
        self.reasoning = ReasoningReading.for_server(
            args.reasoning_parser, args.reasoning_field, tm.tokenizer
        )

    def _reading(self, req: ChatCompletionRequest) -> ReasoningReading | None:
        """How this request's output is read: the server's reasoning format unless the request asked raw."""
        return self.reasoning if req.separate_reasoning else None

    def _think_end_id(self, req: ChatCompletionRequest, params) -> int | None:
        """A constrained request that thinks waits for its grammar until the end tag (one token), as SGLang's
        reasoning grammar does: the constraint shapes the answer, not the thinking."""
        reading = self.reasoning
        if reading is None or reading.end_token_id is None or not req.thinking_enabled:
            return None
        return reading.end_token_id if constraint_key(params) is not None else None

    async def _build(
        self, req: ChatCompletionRequest, request
    ) -> tuple[GenerateInput, AsyncIterator[ReqOutput]]:
        lora = resolve_model(self.tm, req.model, self.model_name)
        messages, tools = ChatTools(req, self.tool_parser).prompt(self.tm.inputs.template_takes_tools)
        ids = await self.tm.inputs.apply_chat_template(
            messages, tools, template_kwargs=req.chat_template_kwargs
        )
        max_new = req.max_new_tokens()
        params = req.to_sampling_params(max_new or 1, req.num_top_logprobs())
        obj = GenerateInput(
            prompts=[ids],
            sampling_params=params,
            n=req.num_samples,
            stream=req.streaming,
            rid=req.rid or uuid.uuid4().hex,
            data_parallel_rank=req.data_parallel_rank,
            fill_max_new_tokens=max_new is None,
            thinking=req.thinking_enabled if self.reasoning is not None else None,
            think_end_id=self._think_end_id(req, params),
            # stop strings apply to the answer: the detokenizer skips the thinking
            stop_after_reasoning=self.reasoning.fmt.name
            if self.reasoning is not None and req.thinking_enabled and params.stop
            else None,
            lora_name=lora,
            prediction_ids=await self.tm.inputs.encode_prediction(req.prediction.text())
            if req.prediction
            else None,
        )
        await self.tm.inputs.judge_constraint(
            params, forced_tools=req.forced_tools is not None, schema_param=req.schema_param
        )
        return obj, self.tm.generate(obj, request)

    async def handle(self, req: ChatCompletionRequest, request):
        try:
            obj, outputs = await self._build(req, request)
        except Exception as e:
            return to_openai_error(e).to_response()
        frame = ResponseFrame.of(
            self.tm,
            req,
            f"chatcmpl-{obj.rid}",
            "chat.completion",
            self.model_name,
            req.num_samples,
            reasoning=self.reasoning is not None,
            chunk_kind="chat.completion.chunk",
        )
        if req.streaming:
            return StreamingResponse(self._stream(req, outputs, frame), media_type="text/event-stream")
        return await collect_response(
            self.tm, outputs, obj.num_choices, lambda choices: self._response(req, choices, frame)
        )

    def _response(self, req: ChatCompletionRequest, choices: list[ChoiceAcc], frame: ResponseFrame) -> dict:
        tools = ChatTools(req, self.tool_parser)
        out = []
        for i, c in enumerate(choices):
            logprobs = (
                chat_logprobs(self.tm, c.output_ids, c.token_logprobs, c.top_logprobs)
                if req.logprobs
                else None
            )
            reading = self._reading(req)
            reasoning, answer = reading.split(c.text, req.thinking_enabled) if reading else ("", c.text)
            message, finish = tools.message(answer, c.finish_reason.to_openai() if c.finish_reason else None)
            if reading is not None:
                message.update(reading.fields(reasoning))
            choice = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
            out.append(frame.timed_choice(choice, c.stats))
        return frame.body(out, choices)

    def _stream(self, req: ChatCompletionRequest, outputs: AsyncIterator[ReqOutput], frame: ResponseFrame):
        n = req.num_samples
        accs = [ChoiceAcc() for _ in range(n)]
        started = [False] * n
        tools = ChatTools(req, self.tool_parser)
        reading = self._reading(req)
        streams = [
            ChoiceReader(
                reading.fmt.new_stream(req.thinking_enabled) if reading else None, tools.new_stream()
            )
            for _ in range(n)
        ]

        def chunk(
            index: int,
            delta: dict,
            finish: str | None = None,
            logprobs: dict | None = None,
            so_far: ChoiceAcc | None = None,
            stats: FinishedRequestStats | None = None,
        ) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return frame.chunk(choice, so_far or accs[index], stats)

        def on_output(out: ReqOutput) -> list[str]:
            accs[out.index].add(out)
            chunks = []
            if not started[out.index]:
                started[out.index] = True
                before = ChoiceAcc(prompt_tokens=accs[out.index].prompt_tokens)  # the role precedes any token
                chunks.append(chunk(out.index, {"role": "assistant", "content": ""}, so_far=before))
            logprobs = None
            if req.logprobs and out.token_logprobs:
                logprobs = chat_logprobs(self.tm, out.output_ids, out.token_logprobs, out.top_logprobs)
            stream = streams[out.index]
            reasoning, read = stream.feed(out.text, final=out.finish_reason is not None)
            delta = stream_delta(read, reading.fields(reasoning) if reasoning else None)
            if delta or logprobs:
                chunks.append(chunk(out.index, delta or {"content": ""}, logprobs=logprobs))
            if out.finish_reason is not None:
                finish = out.finish_reason.to_openai()
                if stream.num_committed:
                    finish = finish_override(finish)
                chunks.append(chunk(out.index, {}, finish=finish, stats=out.stats))
            return chunks

        return stream_with_errors(self.tm, outputs, on_output, lambda: frame.closing_chunks(accs))
