"""`POST /generate`: SGLang's native route (text or input_ids, a `sampling_params` dict, optional stream)."""

from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi.responses import StreamingResponse

from srt.entrypoints.openai.errors import OpenAIError
from srt.entrypoints.openai.protocol import MAX_N, GenerateRequest
from srt.entrypoints.openai.serving_common import (
    ChoiceAcc,
    collect_response,
    sse,
    stream_with_errors,
    to_openai_error,
)
from srt.managers.tokenizer_manager import GenerateInput, ReqOutput, TokenizerManager
from srt.sampling.sampling_params import SamplingParams, SamplingParamsError

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _finish_dict(reason) -> dict | None:
    if reason is None:
        return None
    out = {"type": reason.type, "matched": reason.matched}
    if reason.message:
        out["message"] = reason.message
    return out


class GenerateHandler:
    def __init__(self, tm: TokenizerManager):
        self.tm = tm

    def _build(self, req: GenerateRequest) -> tuple[GenerateInput, bool]:
        """The GenerateInput and whether the answer is a list (several prompts or samples)."""
        if (req.text is None) == (req.input_ids is None):
            raise OpenAIError("exactly one of `text` and `input_ids` is required", param="text")
        sp = dict(req.sampling_params)
        n = sp.pop("n", 1)
        if not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise OpenAIError(
                f"sampling_params.n must be an integer in [1, {MAX_N}]", param="sampling_params.n"
            )
        unknown = sorted(set(sp) - _SAMPLING_FIELDS)
        if unknown:
            raise OpenAIError(f"unknown sampling parameter(s): {', '.join(unknown)}", param="sampling_params")
        if req.return_logprob:
            sp["logprobs"] = req.top_logprobs_num
        try:
            params = SamplingParams(**sp)
            params.verify()  # also catches mistyped values, which fail the comparisons with a TypeError
        except SamplingParamsError as e:
            raise OpenAIError(str(e), param=f"sampling_params.{e.param}") from e
        except (TypeError, ValueError) as e:
            raise OpenAIError(f"invalid sampling_params: {e}", param="sampling_params") from e
        for name in ("max_new_tokens", "min_new_tokens", "top_k"):
            if type(getattr(params, name)) is not int:
                raise OpenAIError(
                    f"sampling_params.{name} must be an integer", param=f"sampling_params.{name}"
                )
        if req.text is not None:
            texts = [req.text] if isinstance(req.text, str) else list(req.text)
            prompts = [self.tm.encode(t) for t in texts]
        else:
            ids = req.input_ids
            prompts = [list(ids)] if ids and isinstance(ids[0], int) else [list(p) for p in ids]
            texts = None
        if not prompts:
            raise OpenAIError("the prompt list is empty", param="text")
        batched = isinstance(req.text, list) or (req.input_ids is not None and len(prompts) != 1) or n > 1
        if batched and req.stream:
            raise OpenAIError("streaming supports a single prompt with n = 1", param="stream")
        obj = GenerateInput(
            prompts=prompts,
            sampling_params=params,
            n=n,
            stream=req.stream,
            rid=req.rid or uuid.uuid4().hex,
            input_texts=texts,
        )
        self.tm.check(obj)
        return obj, batched

    def _result(self, rid: str, c: ChoiceAcc, arrival: float, logprob: bool) -> dict:
        meta = {
            "id": rid,
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens,
            "finish_reason": _finish_dict(c.finish_reason),
            "e2e_latency": time.monotonic() - arrival,
        }
        if logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(c.token_logprobs, c.output_ids, strict=False)
            ]
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in row] for row in c.top_logprobs]
        return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}

    async def handle(self, req: GenerateRequest, request):
        try:
            obj, batched = self._build(req)
        except Exception as e:
            return to_openai_error(e).to_response()
        if req.stream:
            return StreamingResponse(self._stream(req, obj, request), media_type="text/event-stream")
        return await collect_response(
            self.tm, obj, request, lambda choices: self._results(req, obj, choices, batched)
        )

    def _results(self, req: GenerateRequest, obj: GenerateInput, choices: list[ChoiceAcc], batched: bool):
        rids = [obj.rid] if len(choices) == 1 else [f"{obj.rid}-{i}" for i in range(len(choices))]
        results = [
            self._result(r, c, obj.arrival_ts, req.return_logprob) for r, c in zip(rids, choices, strict=True)
        ]
        return results if batched else results[0]

    def _stream(self, req: GenerateRequest, obj: GenerateInput, request):
        """Each event carries the text and ids so far (SGLang's default, non-incremental stream)."""
        acc = ChoiceAcc()

        def on_output(out: ReqOutput) -> list[str]:
            acc.add(out)
            if not out.text and not out.output_ids and out.finish_reason is None:
                return []
            return [sse(self._result(obj.rid, acc, obj.arrival_ts, req.return_logprob))]

        return stream_with_errors(self.tm, obj, request, on_output, list)
