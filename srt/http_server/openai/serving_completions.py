"""`POST /v1/completions`: raw prompts (text or token ids, one or several), OpenAI's shapes."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from srt.http_server.input_processor import GenerateInput, InvalidRequestError
from srt.http_server.openai.protocol import CompletionRequest
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
from srt.http_server.request_types import MAX_SEQUENCES
from srt.http_server.tokenizer_manager import TokenizerManager


def completion_logprobs(
    tm: TokenizerManager,
    ids: list[int],
    logprobs: list[float] | None,
    tops: list[list[tuple[int, float]]] | None,
    offset: int = 0,
) -> dict | None:
    """OpenAI's legacy completions logprobs: parallel lists, top alternatives as {token: logprob}."""
    if logprobs is None:
        return None
    tokens, offsets = [], []
    for token_id in ids[: len(logprobs)]:
        text = token_text(tm, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [None if row is None else {token_text(tm, t): v for t, v in row} for row in tops] if tops else None
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def with_prompt_logprobs(tm: TokenizerManager, out: ChoiceAcc | ReqOutput, logprobs: dict | None) -> dict:
    """`echo` + `logprobs`: the prompt's tokens (the first with a null logprob and null alternatives, as
    OpenAI returns them) followed by the completion's."""
    prompt = completion_logprobs(tm, out.input_token_ids, out.input_token_logprobs, out.input_top_logprobs)
    if logprobs is None:
        return prompt
    joined = {key: prompt[key] + logprobs[key] for key in ("tokens", "token_logprobs", "text_offset")}
    joined["top_logprobs"] = (prompt["top_logprobs"] or []) + (logprobs["top_logprobs"] or [])
    return joined


def best_of(samples: list[ChoiceAcc], generated: int, n: int) -> list[ChoiceAcc]:
    """vLLM's `best_of`: of each prompt's `generated` samples, the `n` with the highest cumulative logprob,
    best first (a stable sort: ties keep sample order). usage still counts every generated token."""
    if generated == n:
        return samples
    chosen = []
    for start in range(0, len(samples), generated):
        group = samples[start : start + generated]
        chosen += sorted(group, key=lambda c: sum(c.token_logprobs), reverse=True)[:n]
    return chosen


class CompletionHandler:
    def __init__(self, tm: TokenizerManager, model_name: str):
        self.tm = tm
        self.model_name = model_name

    async def _build(
        self, req: CompletionRequest, request
    ) -> tuple[GenerateInput, list[str], AsyncIterator[ReqOutput]]:
        lora = resolve_model(self.tm, req.model, self.model_name)
        prompts = req.prompts()
        n = req.num_generated
        if len(prompts) * n > MAX_SEQUENCES:
            raise InvalidRequestError(
                f"{len(prompts)} prompts x {n} samples exceed the limit of {MAX_SEQUENCES} sequences per request",
                "best_of" if req.best_of else "n",
            )
        self.tm.inputs.check_input_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        ids = [await self.tm.inputs.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        texts = [p if isinstance(p, str) else self.tm.inputs.decode_prompt(p) for p in prompts]
        # best_of ranks samples by their logprobs: asked for even when the client did not ask to see them.
        logprobs = 0 if req.logprobs is None and n > req.num_samples else req.logprobs
        params = req.to_sampling_params(req.max_new_tokens, logprobs)
        if req.echo and req.logprobs is not None:  # the prompt's logprobs too, from its first token
            params = dataclasses.replace(params, logprob_start_len=0)
        obj = GenerateInput(
            prompts=ids,
            sampling_params=params,
            n=n,
            stream=req.streaming,
            rid=req.rid or uuid.uuid4().hex,
            data_parallel_rank=req.data_parallel_rank,
            input_texts=texts,
            lora_name=lora,
            # a --reasoning-parser server counts the thinking here too (usage, the counter)
            thinking=True if self.tm.server_args.reasoning_parser else None,
            prediction_ids=await self.tm.inputs.encode_prediction(req.prediction.text())
            if req.prediction
            else None,
        )
        await self.tm.inputs.judge_constraint(obj.sampling_params, schema_param=req.schema_param)
        return obj, texts, self.tm.generate(obj, request)

    async def handle(self, req: CompletionRequest, request):
        try:
            obj, texts, outputs = await self._build(req, request)
        except Exception as e:
            return to_openai_error(e).to_response()
        # usage counts every generated sample (best_of's too); a stream generates only the returned ones
        frame = ResponseFrame.of(
            self.tm,
            req,
            f"cmpl-{obj.rid}",
            "text_completion",
            self.model_name,
            req.num_generated,
            reasoning=self.tm.server_args.reasoning_parser is not None,
        )
        if req.streaming:
            return StreamingResponse(
                self._stream(req, obj, texts, outputs, frame), media_type="text/event-stream"
            )
        return await collect_response(
            self.tm, outputs, obj.num_choices, lambda choices: self._response(req, choices, texts, frame)
        )

    def _response(
        self, req: CompletionRequest, samples: list[ChoiceAcc], texts: list[str], frame: ResponseFrame
    ) -> dict:
        choices = best_of(samples, req.num_generated, req.num_samples)
        out = []
        for i, c in enumerate(choices):
            prefix = texts[i // req.num_samples] if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(
                    self.tm, c.output_ids, c.token_logprobs, c.top_logprobs, len(prefix)
                )
                if req.echo and c.input_token_logprobs is not None:
                    logprobs = with_prompt_logprobs(self.tm, c, logprobs)
            choice = {
                "index": i,
                "text": prefix + c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason.to_openai() if c.finish_reason else None,
            }
            out.append(frame.timed_choice(choice, c.stats))
        return frame.body(out, samples)

    def _stream(
        self,
        req: CompletionRequest,
        obj: GenerateInput,
        texts: list[str],
        outputs: AsyncIterator[ReqOutput],
        frame: ResponseFrame,
    ):
        total = len(obj.prompts) * req.num_samples
        accs = [ChoiceAcc() for _ in range(total)]
        offsets = [len(texts[i // req.num_samples]) if req.echo else 0 for i in range(total)]
        echoed = [not req.echo] * total

        def on_output(out: ReqOutput) -> list[str]:
            accs[out.index].add(out)
            text = out.text
            if not echoed[out.index]:
                echoed[out.index] = True
                text = texts[out.index // req.num_samples] + text
            logprobs = None
            if req.logprobs is not None and out.token_logprobs:
                logprobs = completion_logprobs(
                    self.tm, out.output_ids, out.token_logprobs, out.top_logprobs, offsets[out.index]
                )
                offsets[out.index] += sum(len(t) for t in logprobs["tokens"])
            if req.echo and req.logprobs is not None and out.input_token_logprobs is not None:
                logprobs = with_prompt_logprobs(self.tm, out, logprobs)
            finish = out.finish_reason.to_openai() if out.finish_reason else None
            if not text and finish is None and logprobs is None:
                return []
            choice = {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return [frame.chunk(choice, accs[out.index], out.stats)]

        return stream_with_errors(self.tm, outputs, on_output, lambda: frame.closing_chunks(accs))
