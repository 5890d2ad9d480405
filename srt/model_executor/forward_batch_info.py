"""Per-forward state in one object: what the scheduler hands the model runner for one step."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import chain
from typing import Protocol

import torch

from srt.mem_cache.memory_pool import INDEX_DTYPE, ReqToTokenPool

# A sequence's entry in `ForwardBatch.lora_slots` when it runs on the base model alone.
NO_ADAPTER = -1


class ForwardMode(Enum):
    EXTEND = 1  # prefill: any number of new tokens per sequence, possibly after a cached prefix
    DECODE = 2  # exactly one new token per sequence
    # An extend batch whose last `num_decode` sequences are decoding requests extending by exactly one token
    # with their whole prefix in the pool: a prefill chunk and the running batch's decode in one step.
    MIXED = 3


@dataclass
class ForwardBatch:
    """One step's inputs, built by `lay_out`. Invariant: before `forward` is called, `lay_out` has written
    `req_to_token[req_pool_idx, prefix_len:seq_len] = out_cache_loc` for each sequence, so the attention
    backend finds every token's KV slot (old and new) through `req_to_token`."""

    mode: ForwardMode
    batch_size: int
    input_ids: (
        torch.Tensor
    )  # int64 [num_tokens] (extend: new tokens of each seq, concatenated; decode: one per seq)
    positions: torch.Tensor  # int64 [num_tokens]
    out_cache_loc: torch.Tensor  # int64 [num_tokens] KV slots where this step's K/V are written
    req_pool_indices: torch.Tensor  # int64 [bs]
    seq_lens: torch.Tensor  # int64 [bs] length including this step's tokens
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int] | None = None  # tokens already in KV before this step (extend)
    extend_seq_lens_cpu: list[int] | None = None  # new tokens this step (extend)
    # Prompt logprobs (extend only; None when no sequence asks, so a normal prefill costs nothing extra):
    # rows of this step's token array whose next-token log-probabilities are wanted, the token each row
    # predicts, and the most top alternatives any sequence asks for.
    logprob_rows: torch.Tensor | None = None  # int64 [num_rows]
    logprob_targets: torch.Tensor | None = None  # int64 [num_rows]
    logprob_top_k: int = 0
    num_decode: int = 0  # MIXED: how many sequences at the end of the batch decode one token each
    # Rows of this step's token array whose logits `ModelRunner.forward` returns, in this order (extend only);
    # None: each sequence's last new token. A speculative verify step asks for every row it fed.
    logit_rows: torch.Tensor | None = None  # int64 [rows]
    # Multi-LoRA (srt/lora/): each sequence's adapter slot in the runner's weight pool, NO_ADAPTER for the base;
    # None: every sequence runs on the base.
    lora_slots: list[int] | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.logprob_rows is not None and not self.is_decode

    @property
    def has_adapters(self) -> bool:
        """Whether some sequence of the step runs with a LoRA adapter."""
        return self.lora_slots is not None and max(self.lora_slots, default=NO_ADAPTER) != NO_ADAPTER

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @property
    def is_mixed(self) -> bool:
        return self.mode is ForwardMode.MIXED

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def new_token_counts(self) -> list[int]:
        """New tokens of each sequence in this step (1 each in decode)."""
        if self.is_decode:
            return [1] * self.batch_size
        assert self.extend_seq_lens_cpu is not None, "extend batches must carry extend_seq_lens_cpu"
        return self.extend_seq_lens_cpu


class IndexUpload(Protocol):
    """Host index lists -> int64 tensors on the pools' device (the scheduler's `IndexUploader` stages them
    through reused pinned buffers; `FreshTensors` builds new ones)."""

    def upload(self, name: str, values: list[int]) -> torch.Tensor: ...


class FreshTensors:
    """`IndexUpload` for steps outside the scheduler's loop (a draft model's, a calibration window, a test):
    each list a new tensor on `device`."""

    def __init__(self, device: str | torch.device):
        self.device = device

    def upload(self, name: str, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=INDEX_DTYPE, device=self.device)


def lay_out(
    mode: ForwardMode,
    pool: ReqToTokenPool,
    rows: list[int],
    prefix_lens: list[int],
    fed: list[int],
    fed_lens: list[int],
    out_cache_loc: torch.Tensor,
    upload: IndexUpload,
    **fields,
) -> ForwardBatch:
    """The one layout of a step, whoever runs it (the scheduler's extend, mixed, decode and verify steps, a
    draft model's, a calibration window): sequence i, whose `req_to_token` row `rows[i]` holds the slots of
    its first `prefix_lens[i]` tokens, is fed the next `fed_lens[i]` tokens of `fed` (all sequences' fed
    tokens, concatenated) at positions prefix_len.., their K/V going to the caller's freshly allocated
    `out_cache_loc` (one slot per fed token, in order). Writes those slots into the rows (the invariant
    `ForwardBatch` states) and returns the batch; `fields` are its optional fields (`num_decode`,
    `logit_rows`, `lora_slots`, prompt logprobs).

    DECODE: every sequence is fed one token, so its length is its position + 1, computed on the device. A
    row may appear more than once (a verify step laid out as decode rows: one sequence per fed token)."""
    seq_lens = list(map(operator.add, prefix_lens, fed_lens))
    positions = upload.upload("positions", list(chain.from_iterable(map(range, prefix_lens, seq_lens))))
    req_pool_indices = upload.upload("req_pool_indices", rows)
    if fed_lens.count(1) == len(fed_lens):
        token_rows = req_pool_indices
    else:
        # each fed token's row, repeated on the device: a per-token host list cost more to upload
        counts = upload.upload("fed_lens", fed_lens)
        token_rows = req_pool_indices.repeat_interleave(counts, output_size=len(fed))
    pool.write((token_rows, positions), out_cache_loc)
    decode = mode is ForwardMode.DECODE
    return ForwardBatch(
        mode=mode,
        batch_size=len(rows),
        input_ids=upload.upload("input_ids", fed),
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=req_pool_indices,
        seq_lens=positions + 1 if decode else upload.upload("seq_lens", seq_lens),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=None if decode else prefix_lens,
        extend_seq_lens_cpu=None if decode else fed_lens,
        **fields,
    )


def last_token_rows(new_token_counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row of each sequence's last new token in the step's concatenated token arrays."""
    ends = torch.tensor(new_token_counts, dtype=torch.int64).cumsum(0) - 1
    return ends.to(device)


@dataclass
class PromptLogprobs:
    """Per row of `ForwardBatch.logprob_rows`: the log-probability of its target token under the model's
    raw distribution, and (when `logprob_top_k` > 0) the best alternatives."""

    token_logprobs: torch.Tensor  # fp32 [num_rows]
    top_values: torch.Tensor | None = None  # fp32 [num_rows, logprob_top_k]
    top_indices: torch.Tensor | None = None  # int64 [num_rows, logprob_top_k]
