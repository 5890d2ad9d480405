"""How one benchmark request is sent to each kind of server, and what the client measures from its stream.

Fixed output lengths need a different request field on every server, so the way is a choice of its own:
`ignore_eos` (srt, SGLang, vLLM), `min_tokens` (llama.cpp's server), `generation_config` (transformers
serve, which rejects unknown fields with 422 but takes a per-request generation config), or `none`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from srt_bench.dataset import BenchRequest
from srt_bench.sse import GenerateStreamParser, SSEDecoder, StreamDelta, parse_openai_payload
from srt_bench.stats import RequestResult, stream_timings

BACKENDS = ("srt", "openai")
ENDPOINTS = ("chat", "completions")
FIXED_OUTPUT_MODES = ("ignore_eos", "min_tokens", "generation_config", "none")
ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
GENERATE_PATH = "/generate"
# transformers serve: an EOS id no token has, so generation runs to max_tokens.
NO_EOS_GENERATION_CONFIG = json.dumps({"eos_token_id": -1})
ERROR_BODY_CHARS = 500
READ_CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class Target:
    """Where and how requests go; shared by all requests of a run."""

    base_url: str
    backend: str = "srt"
    endpoint: str = "chat"
    model: str | None = None
    fixed_output: str = "ignore_eos"
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.fixed_output not in FIXED_OUTPUT_MODES:
            raise ValueError(
                f"fixed output mode must be one of {FIXED_OUTPUT_MODES}, got {self.fixed_output!r}"
            )

    @property
    def chat(self) -> bool:
        """Whether prompts are wrapped in the chat template by the server."""
        return self.backend == "openai" and self.endpoint == "chat"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def fixed_output_fields(mode: str, output_len: int) -> dict:
    if mode == "ignore_eos":
        return {"ignore_eos": True}
    if mode == "min_tokens":
        return {"min_tokens": output_len}
    if mode == "generation_config":
        return {"generation_config": NO_EOS_GENERATION_CONFIG}
    return {}


def build_request(target: Target, req: BenchRequest) -> tuple[str, dict]:
    """URL and JSON body of one greedy, streamed request."""
    base = target.base_url.rstrip("/")
    if target.backend == "srt":
        params = {"max_new_tokens": req.output_len, "temperature": 0.0}
        if target.fixed_output == "ignore_eos":
            params["ignore_eos"] = True
        body = {"text": req.prompt, "sampling_params": params, "stream": True}
        if req.lora is not None:
            body["lora_path"] = req.lora
        return base + GENERATE_PATH, {**body, **target.extra_body}
    body: dict = {"max_tokens": req.output_len, "temperature": 0.0, "stream": True}
    if target.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body["stream_options"] = {"include_usage": True}
    if target.model or req.lora:
        body["model"] = req.lora or target.model
    body.update(fixed_output_fields(target.fixed_output, req.output_len))
    body.update(target.extra_body)
    return base + ENDPOINT_PATHS[target.endpoint], body


def _payload_parser(target: Target) -> Callable[[str], StreamDelta]:
    if target.backend == "srt":
        return GenerateStreamParser().parse
    return lambda payload: parse_openai_payload(payload, chat=target.chat)


async def send_request(
    session: aiohttp.ClientSession,
    target: Target,
    req: BenchRequest,
    count_tokens: Callable[[str], int],
    bench_start: float,
) -> RequestResult:
    """Send one request, time every output chunk on arrival, and never raise: failures are results too.

    Token counts come from the server's usage block when it sends one, else from its per-chunk counts, else
    by re-tokenizing the generated text with `count_tokens`."""
    url, body = build_request(target, req)
    result = RequestResult(prompt_len=req.prompt_len)
    parse = _payload_parser(target)
    decoder = SSEDecoder()
    token_times: list[float] = []
    counted_tokens = 0
    usage_prompt = usage_completion = None
    send_time = time.perf_counter()
    result.start = send_time - bench_start
    try:
        async with session.post(url, json=body, headers=target.headers) as resp:
            if resp.status != 200:
                text = await resp.text()
                result.error = f"HTTP {resp.status}: {text[:ERROR_BODY_CHARS]}"
                return result
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                for payload in decoder.feed(chunk):
                    delta = parse(payload)
                    if delta.error:
                        result.error = delta.error
                        return result
                    if delta.has_output:
                        token_times.append(now)
                        result.generated_text += delta.text
                        counted_tokens += delta.new_tokens or 0
                    usage_prompt = delta.prompt_tokens or usage_prompt
                    usage_completion = delta.completion_tokens or usage_completion
            for payload in decoder.flush():
                parse(payload)
        end = time.perf_counter()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if not token_times:
        result.error = "the stream carried no output"
        return result
    result.ttft, result.itl = stream_timings(send_time, token_times)
    result.e2e = end - send_time
    result.prompt_len = usage_prompt or req.prompt_len
    result.output_len = usage_completion or counted_tokens or count_tokens(result.generated_text)
    result.success = True
    return result
