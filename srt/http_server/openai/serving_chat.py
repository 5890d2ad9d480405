"""`POST /v1/chat/completions`: chat template, sampling, and OpenAI's response and chunk shapes."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from srt.constrained import constraint_key
from srt.function_call import DEFAULT_TOOL_CALL_PARSER, StreamDelta, create_tool_call_parser
from srt.http_server.input_processor import GenerateInput
from srt.http_server.openai.chat_reasoning import ChoiceReader, ReasoningReading
from srt.http_server.openai.chat_tools import ChatTools, finish_override
from srt.http_server.openai.protocol import ChatCompletionRequest
from srt.http_server.openai.serving_common import (
    ChoiceAcc,
    chunk_usage,
    collect_response,
    reasoning_tokens,
    resolve_model,
    spec_metrics_block,
    stream_chunk,
    stream_with_errors,
    timing,
    to_openai_error,
    token_text,
    usage,
    usage_chunk,
    wants_timing,
)
from srt.http_server.output_dispatch import ReqOutput
from srt.http_server.tokenizer_manager import TokenizerManager


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
        rid = f"chatcmpl-{obj.rid}"
        created = int(time.time())
        if req.streaming:
            return StreamingResponse(self._stream(req, outputs, rid, created), media_type="text/event-stream")
        return await collect_response(
            self.tm, outputs, obj.num_choices, lambda choices: self._response(req, choices, rid, created)
        )

    def _response(self, req: ChatCompletionRequest, choices: list[ChoiceAcc], rid: str, created: int) -> dict:
        tools = ChatTools(req, self.tool_parser)
        with_timing = wants_timing(self.tm, req.return_timing)
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
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            if with_timing:
                out[-1]["timing"] = timing(c.stats)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": out,
            "usage": usage(
                choices,
                req.num_samples,
                req.prediction is not None,
                reasoning_tokens(self.reasoning is not None, choices),
            ),
        }
        metrics = spec_metrics_block(self.tm.server_args, choices, req.prediction is not None)
        if metrics is not None:
            body["metrics"] = metrics
        return body

    def _stream(self, req: ChatCompletionRequest, outputs: AsyncIterator[ReqOutput], rid: str, created: int):
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
        with_timing = wants_timing(self.tm, req.return_timing)

        def chunk(
            index: int,
            delta: dict,
            finish: str | None = None,
            logprobs: dict | None = None,
            so_far: ChoiceAcc | None = None,
            **more,
        ) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **more}
            extra = chunk_usage(req.include_usage, req.continuous_usage, so_far or accs[index])
            return stream_chunk(rid, "chat.completion.chunk", created, self.model_name, choice, extra)

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
                more = {"timing": timing(out.stats)} if with_timing else {}
                chunks.append(chunk(out.index, {}, finish=finish, **more))
            return chunks

        def on_end() -> list[str]:
            if not req.include_usage:
                return []
            return [
                usage_chunk(
                    rid,
                    "chat.completion.chunk",
                    created,
                    self.model_name,
                    usage(
                        accs,
                        n,
                        req.prediction is not None,
                        reasoning_tokens(self.reasoning is not None, accs),
                    ),
                    spec_metrics_block(self.tm.server_args, accs, req.prediction is not None),
                )
            ]

        return stream_with_errors(self.tm, outputs, on_output, on_end)
