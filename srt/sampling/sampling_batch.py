"""A sampling batch: the per-row sampling parameters of one set of requests, as tensors.

Built when the batch changes (a request joins, finishes or is retracted) and reused by every step while it
does not, so a steady decode step builds no parameter tensor. What changes from step to step without the
batch changing is read at sampling time: the rows whose min_new_tokens is still active, and the penalty
counts (kept incrementally in the sampler's `PenaltyPool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from srt.sampling.logit_bias import logit_bias_triples
from srt.sampling.penalties import (
    BatchPenalties,
    PenalizedRow,
    PenaltyPool,
    banned_token_ids,
)
from srt.sampling.sampling_params import SamplingParams
from srt.sampling.token_filters import (
    FLOAT32_MAX,
    TokenFilters,
    draw_uniforms,
    generator_groups,
    sample_from_probs,
)


class SamplingRow(PenalizedRow, Protocol):
    """What a batch needs of a request (the scheduler's `Req` is one)."""

    generator: torch.Generator | None


@dataclass
class RandomRows:
    """The rows that sample (not greedy): their indices, temperatures, filters and generators."""

    rows: torch.Tensor  # int64 [R], rows of the batch
    temperature: torch.Tensor  # [R, 1]
    filters: TokenFilters
    groups: list[tuple[torch.Generator | None, torch.Tensor]]  # generator -> rows among the R

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """These rows' distributions [R, vocab] from their (already penalized and masked) logits: temperature,
        then the filters; filtered tokens are 0 and the rest not renormalized. Speculative verification
        judges drafts against them."""
        # +inf (a repetition penalty so small that the division overflows) becomes the largest float: the
        # row then samples among those tokens alone, the limit it stands for, instead of a softmax of NaN
        return self.filters.apply((logits / self.temperature).clamp_(max=FLOAT32_MAX))

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Next tokens of these rows from their (already penalized and masked) logits [R, vocab]."""
        probs = self.probs(logits)
        return sample_from_probs(probs, draw_uniforms(self.groups, probs.shape[0], probs.device))


@dataclass
class SamplingBatch:
    rows: Sequence[SamplingRow]
    plain: bool  # every row greedy, no logprobs, penalty or bias: argmax (unless min_new/grammar apply)
    greedy_rows: torch.Tensor | None  # rows taking the argmax when some rows sample; None if none or all
    random: RandomRows | None
    logprob_ks: list[int] | None  # per row, top logprobs wanted; None when no row wants logprobs
    penalties: BatchPenalties | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    min_new_rows: list[int]  # rows with a min_new_tokens floor
    banned: dict[int, list[int]]  # row -> tokens forbidden until its floor is reached

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        eos_token_ids: list[int],
        pool: PenaltyPool,
        device="cpu",
    ) -> SamplingBatch:
        """Raises for a request whose parameters cannot be turned into tensors (before any random draw)."""
        params = [r.sampling_params for r in rows]
        want_logprobs = any(p.logprobs is not None for p in params)
        bias = logit_bias_triples(params, vocab_size, device)
        penalties = BatchPenalties.build(pool, rows)
        random_idx = [i for i, p in enumerate(params) if not p.is_greedy]
        greedy_idx = [i for i, p in enumerate(params) if p.is_greedy]
        random = None
        if random_idx:
            chosen = [params[i] for i in random_idx]
            random = RandomRows(
                torch.tensor(random_idx, dtype=torch.int64, device=device),
                # past float32's range a temperature would be inf, and a masked token's -inf / inf is NaN
                torch.tensor([min(p.temperature, FLOAT32_MAX) for p in chosen], device=device).unsqueeze(1),
                TokenFilters.build(
                    [p.top_k for p in chosen],
                    [p.top_p for p in chosen],
                    [p.min_p for p in chosen],
                    vocab_size,
                    device,
                ),
                generator_groups([rows[i].generator for i in random_idx], device),
            )
        min_new_rows = [i for i, p in enumerate(params) if p.min_new_tokens > 0]
        return cls(
            rows=rows,
            plain=not (random_idx or want_logprobs or penalties is not None or bias is not None),
            greedy_rows=(
                torch.tensor(greedy_idx, dtype=torch.int64, device=device)
                if greedy_idx and random_idx
                else None
            ),
            random=random,
            logprob_ks=[p.logprobs or 0 for p in params] if want_logprobs else None,
            penalties=penalties,
            bias=bias,
            min_new_rows=min_new_rows,
            banned={i: banned_token_ids(params[i], eos_token_ids) for i in min_new_rows},
        )

    def active_min_new_rows(self) -> list[int]:
        """Rows that may not stop yet (fewer outputs than their min_new_tokens): read each step."""
        rows = self.rows
        return [
            i for i in self.min_new_rows if len(rows[i].output_ids) < rows[i].sampling_params.min_new_tokens
        ]


@dataclass
class ListRow:
    """A `SamplingRow` from plain values, for one-off sampling calls and tests."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None = None
    penalty_row: int | None = None


def one_off_batch(
    params: list[SamplingParams],
    input_ids: list[list[int]],
    output_ids: list[list[int]],
    generators: list[torch.Generator | None],
    vocab_size: int,
    eos_token_ids: list[int],
    device="cpu",
) -> SamplingBatch:
    """A batch with its own throwaway penalty pool (penalties computed from each row's whole context)."""
    rows = [ListRow(*fields) for fields in zip(params, input_ids, output_ids, generators, strict=True)]
    return SamplingBatch.build(rows, vocab_size, eos_token_ids, PenaltyPool(vocab_size, device), device)
