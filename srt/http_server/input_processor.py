"""The main process's input side: from a validated HTTP request to checked token ids and sampling params.

The request models (srt/http_server) checked types and ranges; what needs the model is checked here — the
vocabulary, the context length, and (`judge_constraint`, through srt/constrained/judge.py, off the event
loop) whether a constraint can be enforced. Texts are refused by size before they are tokenized, and long
ones are tokenized on worker threads so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from srt.constrained import GrammarError, constraint_key
from srt.constrained.judge import GrammarJudge, JudgeUnavailable
from srt.reasoning.parser import REASONING_CONTENT
from srt.sampling.sampling_params import SamplingParams

# A text longer than context_len * MAX_CHARS_PER_TOKEN cannot fit the context with any tokenizer in practice
# (English averages ~4 characters per token): it is refused before tokenizing, which would otherwise cost
# about a second per megabyte.
MAX_CHARS_PER_TOKEN = 32
# Longer texts are tokenized on worker threads (the Rust tokenizer releases the GIL), so the event loop keeps
# serving; shorter ones cost less than the hand-off.
INLINE_TOKENIZE_CHARS = 4096
INLINE_DECODE_IDS = 1024  # the same for decoding token ids (about as many characters)
TOKENIZER_THREADS = 2


class InvalidRequestError(ValueError):
    """The client asked for something this server cannot do (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ServerUnavailableError(RuntimeError):
    """A child process died: the server cannot serve requests any more (HTTP 503)."""


class ClientDisconnected(Exception):
    """The HTTP client went away while its request ran; the request was aborted."""


@dataclass
class GenerateInput:
    """One HTTP request as the TokenizerManager sees it: prompts (token ids) times `n` samples."""

    prompts: list[list[int]]
    sampling_params: SamplingParams
    n: int = 1
    stream: bool = False
    rid: str | None = None
    # True when the client set no output limit: each prompt may then fill the rest of the context.
    fill_max_new_tokens: bool = False
    input_texts: list[str | None] | None = None
    arrival_ts: float = field(default_factory=time.monotonic)
    # OpenAI's Predicted Outputs, tokenized without special tokens: every sample drafts from it
    prediction_ids: list[int] | None = None
    lora_name: str | None = None  # the LoRA adapter every sample runs with (None: the base model)
    # The data-parallel replica every sample runs on; None lets the DataParallelRouter choose.
    data_parallel_rank: int | None = None
    # On a --reasoning-parser server: whether the request thinks (False: Qwen3's enable_thinking off), so
    # its output is read for reasoning tokens and the time to its first answer token; None: not read.
    thinking: bool | None = None
    # its constraint starts after this token (a reasoning model's one-token end tag; docs/reasoning.md)
    think_end_id: int | None = None
    # with stop strings: the reasoning format whose thinking they skip (docs/reasoning.md, "Stop strings")
    stop_after_reasoning: str | None = None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


class InputProcessor:
    """Tokenizes and checks requests for one model; `set_limits` gives it the scheduler's limits."""

    def __init__(self, tokenizer, grammar_backend: str):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.grammar_backend = grammar_backend
        self.context_len = 0
        self.max_req_input_len = 0
        self.judge: GrammarJudge | None = None
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    def set_limits(self, context_len: int, max_req_input_len: int) -> None:
        self.context_len = context_len
        self.max_req_input_len = max_req_input_len

    def set_judge(self, judge: GrammarJudge) -> None:
        self.judge = judge

    async def judge_constraint(
        self, params: SamplingParams, forced_tools: bool = False, schema_param: str = "json_schema"
    ) -> None:
        """A 400 naming the field unless the request's constraint (if any) can be enforced: a forced tool
        choice's grammar holds the tools' parameter schemas, so a bad one is `tools`' fault; a JSON schema
        is `schema_param`'s (`response_format` or SGLang's `json_schema`)."""
        key = constraint_key(params)
        if key is None:
            return
        assert self.judge is not None, "set_judge() must run before constrained requests are checked"
        try:
            await self.judge.check(key)
        except JudgeUnavailable as e:  # the judge itself could not run: not the constraint's fault
            raise ServerUnavailableError(f"structured output is unavailable: {e}") from e
        except GrammarError as e:
            if forced_tools:
                raise InvalidRequestError(
                    f"the tools' parameter schemas cannot be enforced: {e}", "tools"
                ) from e
            raise InvalidRequestError(str(e), schema_param if e.kind == "json_schema" else e.kind) from e

    @property
    def max_input_chars(self) -> int:
        """Most characters a request's text may have: more could never fit the context."""
        return self.context_len * MAX_CHARS_PER_TOKEN

    def check_input_chars(self, chars: int, param: str) -> None:
        if chars > self.max_input_chars:
            raise InvalidRequestError(
                f"the input has {chars} characters; this server accepts at most {self.max_input_chars} "
                f"({MAX_CHARS_PER_TOKEN} per token of its {self.context_len}-token context)",
                param,
            )

    async def _call(self, inline: bool, fn, *args):
        """`fn(*args)` here when the work is short (cheaper than a hand-off), else on a tokenizer thread."""
        if inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _tokenize(self, text: str, **kw) -> list[int]:
        return await self._call(
            len(text) <= INLINE_TOKENIZE_CHARS, lambda: self.tokenizer(text, **kw).input_ids
        )

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, refused by size before any tokenizing, off the event loop when long."""
        self.check_input_chars(len(text), param)
        return await self._tokenize(text, add_special_tokens=add_special_tokens)

    @functools.cached_property
    def _template_arguments(self) -> frozenset[str]:
        """The tokenizer's own `apply_chat_template` arguments (messages, tools, tokenize …): a request's
        `chat_template_kwargs` may add template variables, never set these."""
        params = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        return frozenset(p.name for p in params if p.kind is not p.VAR_KEYWORD) | {"messages"}

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (else the tool-call format writes them into the
        messages: srt/function_call)."""
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    async def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,  # the template writes the special tokens it wants
        template_kwargs: dict | None = None,  # a request's `chat_template_kwargs` (Qwen3's enable_thinking)
    ) -> list[int]:
        chars = sum(len(m["content"] or "") + len(m.get(REASONING_CONTENT) or "") for m in messages)
        chars += len(json.dumps(tools)) if tools else 0
        chars += len(json.dumps(template_kwargs)) if template_kwargs else 0
        self.check_input_chars(chars, "messages")
        taken = set(template_kwargs or ()) & self._template_arguments
        if taken:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {sorted(taken)}: the server sets them",
                "chat_template_kwargs",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except Exception as e:  # a template may reject role orders (e.g. two system messages)
            raise InvalidRequestError(f"the chat template rejected these messages: {e}", "messages") from e
        return await self._tokenize(text, add_special_tokens=add_special_tokens)

    async def encode_prediction(self, text: str) -> list[int] | None:
        """A request's `prediction` as token ids (None when empty). It can never be longer than the context
        allows an answer to be, so a longer one is a 400 rather than drafts that could never be used."""
        ids = await self.encode(text, "prediction", add_special_tokens=False)
        if len(ids) > self.context_len:
            raise InvalidRequestError(
                f"the prediction has {len(ids)} tokens, more than this server's {self.context_len}-token "
                "context",
                "prediction",
            )
        return ids or None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})", param)

    async def decode(self, ids: list[int], param: str = "tokens") -> str:
        """The text of any token ids in the vocabulary (`/detokenize`), off the event loop when long."""
        self.check_token_ids(ids, param)
        return await self._call(len(ids) <= INLINE_DECODE_IDS, self.tokenizer.decode, ids)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (byte-level pieces, as the tokenizer stores them)."""
        return self.tokenizer.convert_ids_to_tokens(ids)

    def decode_prompt(self, ids: list[int]) -> str:
        """The text of a token-id prompt (for `echo`), after checking the ids are in the vocabulary."""
        self.check_token_ids(ids, "prompt")
        return self.tokenizer.decode(ids)

    def check(self, obj: GenerateInput) -> list[SamplingParams]:
        """Check every prompt against the scheduler's limits (the request models checked types and ranges)
        and return each prompt's sampling params."""
        assert self.max_req_input_len, "set_limits() must run before requests are checked"
        base = obj.sampling_params
        self.check_token_ids(base.stop_token_ids, "stop_token_ids")
        if base.logit_bias:
            self.check_token_ids(list(base.logit_bias), "logit_bias")
        if base.top_k >= self.vocab_size:
            base = dataclasses.replace(base, top_k=-1)  # the whole vocabulary, as asked
        out = []
        for ids in obj.prompts:
            if not ids:
                raise InvalidRequestError("the prompt is empty", "prompt")
            self.check_token_ids(ids, "prompt")
            if len(ids) > self.max_req_input_len:
                raise InvalidRequestError(
                    f"the prompt has {len(ids)} tokens, more than this server's maximum input length of "
                    f"{self.max_req_input_len} tokens",
                    "messages" if obj.input_texts is None else "prompt",
                )
            params = base
            room = self.context_len - len(ids)
            if obj.fill_max_new_tokens:
                params = dataclasses.replace(params, max_new_tokens=max(1, room))
            elif params.max_new_tokens > room:
                raise InvalidRequestError(
                    f"max_tokens ({params.max_new_tokens}) plus the prompt's {len(ids)} tokens exceed the "
                    f"model's context length of {self.context_len} tokens",
                    "max_tokens",
                )
            if params.logprob_start_len is not None and params.logprob_start_len >= len(ids):
                raise InvalidRequestError(
                    f"logprob_start_len ({params.logprob_start_len}) must be less than the prompt's "
                    f"{len(ids)} tokens",
                    "logprob_start_len",
                )
            if params.min_new_tokens > params.max_new_tokens:
                raise InvalidRequestError("min_tokens must not exceed max_tokens", "min_tokens")
            out.append(params)
        return out
