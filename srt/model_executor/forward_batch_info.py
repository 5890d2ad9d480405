"""Per-forward state in one object: what the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class ForwardMode(Enum):
    EXTEND = 1  # prefill: any number of new tokens per sequence, possibly after a cached prefix
    DECODE = 2  # exactly one new token per sequence


@dataclass
class ForwardBatch:
    """One step's inputs. Invariant: before `forward` is called, the scheduler has written
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

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def new_token_counts(self) -> list[int]:
        """New tokens of each sequence in this step (1 each in decode)."""
        if self.is_decode:
            return [1] * self.batch_size
        assert self.extend_seq_lens_cpu is not None, "extend batches must carry extend_seq_lens_cpu"
        return self.extend_seq_lens_cpu
