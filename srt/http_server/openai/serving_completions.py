"""`POST /v1/completions`: raw prompts (text or token ids, one or several), OpenAI's shapes."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from srt.http_server.input_processor import GenerateInput, InvalidRequestError
from srt.http_server.openai.protocol import CompletionRequest
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

    def _reasoning_tokens(self, choices: list[ChoiceAcc]) -> list[int] | None:
        return reasoning_tokens(self.tm.server_args.reasoning_parser is not None, choices)

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
        rid = f"cmpl-{obj.rid}"
        created = int(time.time())
        if req.streaming:
            return StreamingResponse(
                self._stream(req, obj, texts, outputs, rid, created), media_type="text/event-stream"
            )
        return await collect_response(
            self.tm,
            outputs,
            obj.num_choices,
            lambda choices: self._response(req, choices, texts, rid, created),
        )

    def _response(
        self, req: CompletionRequest, samples: list[ChoiceAcc], texts: list[str], rid: str, created: int
    ):
        choices = best_of(samples, req.num_generated, req.num_samples)
        with_timing = wants_timing(self.tm, req.return_timing)
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
            out.append(
                {
                    "index": i,
                    "text": prefix + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason.to_openai() if c.finish_reason else None,
                }
            )
            if with_timing:
                out[-1]["timing"] = timing(c.stats)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": out,
            "usage": usage(
                samples, req.num_generated, req.prediction is not None, self._reasoning_tokens(samples)
            ),
        }
        metrics = spec_metrics_block(self.tm.server_args, samples, req.prediction is not None)
        if metrics is not None:
            body["metrics"] = metrics
        return body

    def _stream(
        self,
        req: CompletionRequest,
        obj: GenerateInput,
        texts: list[str],
        outputs: AsyncIterator[ReqOutput],
        rid: str,
        created: int,
    ):
        total = len(obj.prompts) * req.num_samples
        accs = [ChoiceAcc() for _ in range(total)]
        offsets = [len(texts[i // req.num_samples]) if req.echo else 0 for i in range(total)]
        echoed = [not req.echo] * total
        with_timing = wants_timing(self.tm, req.return_timing)

        def chunk(index: int, text: str, finish: str | None, logprobs: dict | None, stats=None) -> str:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if with_timing and finish is not None:
                choice["timing"] = timing(stats)
            extra = chunk_usage(req.include_usage, req.continuous_usage, accs[index])
            return stream_chunk(rid, "text_completion", created, self.model_name, choice, extra)

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
            return [chunk(out.index, text, finish, logprobs, out.stats)]

        def on_end() -> list[str]:
            if not req.include_usage:
                return []
            return [
                usage_chunk(
                    rid,
                    "text_completion",
                    created,
                    self.model_name,
                    usage(accs, req.num_samples, req.prediction is not None, self._reasoning_tokens(accs)),
                    spec_metrics_block(self.tm.server_args, accs, req.prediction is not None),
                )
            ]

        return stream_with_errors(self.tm, outputs, on_output, on_end)
