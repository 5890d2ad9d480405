"""`/tokenize` and `/detokenize`: the ids the generation routes would prefill for a text or a chat, and back.

A chat is rendered exactly as `/v1/chat/completions` renders it (the same template call, the same handling
of `tools`), so `count` equals that route's `usage.prompt_tokens` for the same messages; a prompt is
tokenized as `/v1/completions` tokenizes it. Answers carry `max_model_len`, so a client can see whether the
text fits.
"""

from __future__ import annotations

from srt.entrypoints.openai.chat_tools import ChatTools
from srt.entrypoints.openai.serving_common import check_model, to_openai_error
from srt.entrypoints.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from srt.function_call import ToolCallParser
from srt.managers.tokenizer_manager import TokenizerManager


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

    def _answer(self, ids: list[int], token_strs: bool) -> dict:
        out = {"count": len(ids), "max_model_len": self.tm.context_len, "tokens": ids}
        if token_strs:
            out["token_strs"] = self.tm.inputs.token_strings(ids)
        return out

    async def tokenize(self, req: TokenizeRequest):
        try:
            check_model(req.model, self.model_name)
            if req.messages is not None:
                return self._answer(await self._chat_ids(req), req.return_token_strs)
            special = req.add_special_tokens is not False
            texts = req.prompt if req.batched else [req.prompt]
            answers = [
                self._answer(
                    await self.tm.inputs.encode(t, add_special_tokens=special), req.return_token_strs
                )
                for t in texts
            ]
        except Exception as e:
            return to_openai_error(e).to_response()
        if not req.batched:
            return answers[0]
        # SGLang's batch shape: each field a list, one entry per text
        return {key: [a[key] for a in answers] for key in answers[0]} | {"max_model_len": self.tm.context_len}

    async def detokenize(self, req: DetokenizeRequest):
        try:
            check_model(req.model, self.model_name)
            text = await self.tm.inputs.decode(req.tokens)
        except Exception as e:
            return to_openai_error(e).to_response()
        return {"prompt": text, "text": text}  # vLLM's name, and SGLang's
