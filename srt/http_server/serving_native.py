"""`POST /generate`: SGLang's native route (text or input_ids, a `sampling_params` dict, optional stream)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from srt.http_server.input_processor import GenerateInput, InvalidRequestError
from srt.http_server.native_protocol import GenerateRequest
from srt.http_server.openai.errors import OpenAIError
from srt.http_server.openai.serving_common import (
    ChoiceAcc,
    collect_response,
    resolve_model,
    sse,
    stream_with_errors,
    to_openai_error,
)
from srt.http_server.output_dispatch import ReqOutput
from srt.http_server.request_types import MAX_SEQUENCES
from srt.http_server.tokenizer_manager import TokenizerManager


def _finish_dict(reason) -> dict | None:
    if reason is None:
        return None
    out = {"type": reason.type, "matched": reason.matched}
    if reason.message:
        out["message"] = reason.message
    return out


# The TokenizerManager names OpenAI's fields in its errors; /generate's clients know SGLang's names.
_NATIVE_PARAM = {
    "prompt": "input_ids",
    "messages": "text",
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "stop_token_ids": "sampling_params.stop_token_ids",
    "logit_bias": "sampling_params.logit_bias",
    "response_format": "sampling_params.json_schema",
    "json_schema": "sampling_params.json_schema",
    "regex": "sampling_params.regex",
    "ebnf": "sampling_params.ebnf",
}


class GenerateHandler:
    def __init__(self, tm: TokenizerManager):
        self.tm = tm

    async def _build(
        self, req: GenerateRequest, request
    ) -> tuple[GenerateInput, AsyncIterator[ReqOutput], bool]:
        """The request, its running outputs, and whether the answer is a list (several prompts or samples)."""
        sp = req.sampling_params
        n = sp.n
        if req.text is not None:
            texts = list(req.text)
            self.tm.inputs.check_input_chars(sum(map(len, texts)), "text")
            prompts = [await self.tm.inputs.encode(t, "text") for t in texts]
        else:
            texts, prompts = None, list(req.input_ids)
        if len(prompts) * n > MAX_SEQUENCES:
            raise OpenAIError(
                f"{len(prompts)} prompts x n={n} exceed the limit of {MAX_SEQUENCES} sequences per request",
                param="sampling_params.n",
            )
        batched = req.batched_input or n > 1
        if batched and req.stream:
            raise OpenAIError("streaming supports a single prompt with n = 1", param="stream")
        obj = GenerateInput(
            prompts=prompts,
            sampling_params=sp.to_sampling_params(
                req.top_logprobs_num if req.return_logprob else None,
                req.logprob_start_len if req.return_logprob and req.logprob_start_len >= 0 else None,
            ),
            n=n,
            stream=req.stream,
            rid=req.rid or uuid.uuid4().hex,
            data_parallel_rank=req.data_parallel_rank,
            input_texts=texts,
            lora_name=resolve_model(self.tm, None, self.tm.server_args.model_name, req.lora_path),
        )
        await self.tm.inputs.judge_constraint(obj.sampling_params)
        return obj, self.tm.generate(obj, request), batched

    def _result(self, rid: str, c: ChoiceAcc, arrival: float, logprob: bool) -> dict:
        meta = {
            "id": rid,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens,
            "finish_reason": _finish_dict(c.finish_reason),
            "e2e_latency": time.monotonic() - arrival,
        }
        if c.stats is not None:  # finished: SGLang's timings, the values /metrics observed for it
            meta.update(c.stats.timings())
        if c.spec_stats is not None:  # finished after verify steps (docs/speculative_decoding.md)
            meta.update(c.spec_stats.sglang_meta_info())
        if logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(c.token_logprobs, c.output_ids, strict=False)
            ]
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in row] for row in c.top_logprobs]
            if c.input_token_logprobs is not None:
                meta["input_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(c.input_token_logprobs, c.input_token_ids, strict=True)
                ]
                meta["input_top_logprobs"] = [
                    None if row is None else [[lp, t, None] for t, lp in row] for row in c.input_top_logprobs
                ]
        return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}

    async def handle(self, req: GenerateRequest, request):
        try:
            obj, outputs, batched = await self._build(req, request)
        except InvalidRequestError as e:
            param = (
                "text"
                if e.param == "prompt" and req.text is not None
                else _NATIVE_PARAM.get(e.param, e.param)
            )
            return OpenAIError(str(e), param=param).to_response()
        except Exception as e:
            return to_openai_error(e).to_response()
        if req.stream:
            return StreamingResponse(self._stream(req, obj, outputs), media_type="text/event-stream")
        return await collect_response(
            self.tm, outputs, obj.num_choices, lambda choices: self._results(req, obj, choices, batched)
        )

    def _results(self, req: GenerateRequest, obj: GenerateInput, choices: list[ChoiceAcc], batched: bool):
        rids = [obj.rid] if len(choices) == 1 else [f"{obj.rid}-{i}" for i in range(len(choices))]
        results = [
            self._result(r, c, obj.arrival_ts, req.return_logprob) for r, c in zip(rids, choices, strict=True)
        ]
        return results if batched else results[0]

    def _stream(self, req: GenerateRequest, obj: GenerateInput, outputs: AsyncIterator[ReqOutput]):
        """Each event carries the text and ids so far (SGLang's default, non-incremental stream)."""
        acc = ChoiceAcc()

        def on_output(out: ReqOutput) -> list[str]:
            acc.add(out)
            if not out.text and not out.output_ids and out.finish_reason is None:
                return []
            return [sse(self._result(obj.rid, acc, obj.arrival_ts, req.return_logprob))]

        return stream_with_errors(self.tm, outputs, on_output, list)
