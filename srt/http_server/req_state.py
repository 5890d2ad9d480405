"""`ReqState`: what the HTTP process keeps per internal request. A leaf module, so that the observers that
read it (the request metrics recorder, the request tracer) need not import the TokenizerManager that owns
the states."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from srt.metrics.request_stats import TokenStamps
from srt.sampling.sampling_params import SamplingParams


@dataclass
class ReqState:
    """Per internal request: where its outputs go and the main-process stamps its metrics need."""

    rid: str
    index: int
    queue: asyncio.Queue
    arrival_ts: float
    prompt_tokens: int
    max_new_tokens: int
    n: int
    group: str  # the rid the client knows; freed for reuse when its last sample finishes
    abandoned: bool = False  # the handler is gone; outputs are only counted, not delivered
    logprob_ids: list[int] | None = None  # prompt[logprob_start_len:] when prompt logprobs are asked
    labels: tuple[str, ...] = ()  # custom metric label values (srt/metrics/custom_labels.py)
    params: SamplingParams | None = None
    export: bool = True  # written to the request export (health checks are not)
    lora_name: str | None = None  # the LoRA adapter it runs with
    thinking: bool | None = None  # GenerateInput.thinking: its output is read for reasoning when not None
    # the metrics recorder's stamps (written by it alone; the state itself is written only by its manager)
    stamps: TokenStamps = field(default_factory=TokenStamps)
