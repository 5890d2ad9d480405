"""Logit penalties and the min_new_tokens mask.

Penalty state is kept incrementally per request, never rebuilt from the whole context each step: a request
that uses a penalty owns one row of a `PenaltyPool` (how often each token occurs in its output, and which
tokens its prompt or output contain), filled once from its context when it joins a sampling batch and then
updated with one scatter per step. Rebuilding from the context cost O(context) per request per step (60-80
ms per step at batch 64 with 8k-token prompts); applying the rows costs O(penalized rows x vocabulary)
dense tensor work, independent of the context length.

Each `apply` edits `logits` ([batch, vocab], a tensor the caller owns) in place and touches only the rows
concerned, so a batch of plain requests never reaches this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from srt.sampling.sampling_params import SamplingParams

NO_REPETITION_PENALTY = 1.0
SMALLEST_REPETITION_PENALTY = torch.finfo(torch.float32).tiny  # the smallest normal float32
# Rows the pool starts with when the first penalized request arrives; it doubles when full.
MIN_POOL_ROWS = 8


def uses_penalties(p: SamplingParams) -> bool:
    return (
        p.repetition_penalty != NO_REPETITION_PENALTY
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


def min_new_tokens_active(p: SamplingParams, num_output: int) -> bool:
    return num_output < p.min_new_tokens


class PenalizedRow(Protocol):
    """What the pool needs of a request (the scheduler's `Req` is one): its context and its pool row."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    penalty_row: int | None


def _in_vocab(ids: Sequence[int], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """The ids inside [0, vocab) as an int64 tensor (a negative id would otherwise index from the end); a list
    that is no list of 64-bit ints raises."""
    tokens = torch.tensor(list(ids), dtype=torch.int64, device=device)
    return tokens[(tokens >= 0) & (tokens < vocab_size)]


class PenaltyPool:
    """Per-request penalty state, one row per request that uses a penalty.

    `counts[row, t]`: occurrences of token t in the request's output (frequency and presence penalties).
    `rep_factor[row, t]`: the request's repetition penalty where t occurs in its prompt or output, else 1.0
    (kept as the factor itself, not a flag, so that applying it is plain arithmetic: a `torch.where` over
    [rows, vocab] costs ten times a multiplication on this CPU).
    Contract: `acquire` fills a row from the request's whole context; after that the holder reports every
    token it appends with `add_tokens`, and `release`s the row when the request leaves the running batch
    (finished or retracted; a retracted request acquires a fresh row from its context when it resumes).
    """

    def __init__(self, vocab_size: int, device: str = "cpu"):
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.rep_factor = torch.ones(0, vocab_size, dtype=torch.float32, device=device)
        self.repetition = torch.ones(0, dtype=torch.float32, device=device)  # each row's penalty
        self._free: list[int] = []
        self._scratch = torch.empty(3, 0, vocab_size, device=device)

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, prompt_ids: Sequence[int], output_ids: Sequence[int], repetition_penalty: float) -> int:
        prompt = _in_vocab(prompt_ids, self.vocab_size, self.device)
        output = _in_vocab(output_ids, self.vocab_size, self.device)
        if not self._free:
            self._grow()
        row = self._free.pop()
        # a penalty that float32 holds as 0 (below ~1e-45) would make a zero logit 0 / 0 = NaN; the smallest
        # normal float still sends every seen token's positive logit to +inf, as the request means
        repetition_penalty = max(repetition_penalty, SMALLEST_REPETITION_PENALTY)
        self.counts[row] = torch.bincount(output, minlength=self.vocab_size)
        self.repetition[row] = repetition_penalty
        self.rep_factor[row] = NO_REPETITION_PENALTY
        self.rep_factor[row, prompt] = repetition_penalty
        self.rep_factor[row, output] = repetition_penalty
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def add_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """One new token per row (rows are distinct): the incremental update after a sampling step."""
        self.counts[rows, tokens] += 1.0
        self.rep_factor[rows, tokens] = self.repetition[rows]

    def scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [rows, vocab] fp32 work buffers, allocated once and reused by every step (a fresh
        multi-megabyte tensor per step is a fresh mmap whose page faults cost more than the arithmetic)."""
        if self._scratch.shape[1] < rows:
            self._scratch = torch.empty(3, max(rows, self.capacity), self.vocab_size, device=self.device)
        return self._scratch[0, :rows], self._scratch[1, :rows]

    def gathered(self, rows: int) -> torch.Tensor:
        """A third work buffer: the penalized rows of the logits when not every row is penalized."""
        self.scratch(rows)
        return self._scratch[2, :rows]

    def _grow(self) -> None:
        old = self.capacity
        new = max(MIN_POOL_ROWS, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        rep_factor = torch.ones(new, self.vocab_size, dtype=torch.float32, device=self.device)
        repetition = torch.ones(new, dtype=torch.float32, device=self.device)
        counts[:old], rep_factor[:old], repetition[:old] = self.counts, self.rep_factor, self.repetition
        self.counts, self.rep_factor, self.repetition = counts, rep_factor, repetition
        self._free.extend(reversed(range(old, new)))  # lowest row first


@dataclass
class BatchPenalties:
    """The penalized rows of one sampling batch and their coefficients, built when the batch changes."""

    pool: PenaltyPool
    batch_rows: torch.Tensor  # int64 [P]: rows of the batch that use a penalty
    pool_rows: torch.Tensor  # int64 [P]: their rows in the pool
    all_rows: bool  # every batch row is penalized: no gather/scatter of logits
    repetition: str | None  # "min" when every penalty is >= 1, "max" when every one is <= 1, else "mixed"
    frequency: torch.Tensor | None  # [P, 1]; 0.0 where a row has none
    presence: torch.Tensor | None  # [P, 1]; 0.0 where a row has none

    @classmethod
    def build(cls, pool: PenaltyPool, rows: Sequence[PenalizedRow]) -> BatchPenalties | None:
        """Acquires a pool row for each penalized request that has none yet (new or resumed)."""
        batch_rows = [i for i, r in enumerate(rows) if uses_penalties(r.sampling_params)]
        if not batch_rows:
            return None
        for i in batch_rows:
            if rows[i].penalty_row is None:
                row, params = rows[i], rows[i].sampling_params
                row.penalty_row = pool.acquire(
                    row.origin_input_ids, row.output_ids, params.repetition_penalty
                )
        params = [rows[i].sampling_params for i in batch_rows]

        def column(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in params]
            if all(v == 0.0 for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=pool.device).unsqueeze(1)

        reps = [p.repetition_penalty for p in params]
        repetition = None
        if any(r != NO_REPETITION_PENALTY for r in reps):
            repetition = "min" if min(reps) >= 1.0 else "max" if max(reps) <= 1.0 else "mixed"
        return cls(
            pool,
            torch.tensor(batch_rows, dtype=torch.int64, device=pool.device),
            torch.tensor([rows[i].penalty_row for i in batch_rows], dtype=torch.int64, device=pool.device),
            len(batch_rows) == len(rows),
            repetition,
            column("frequency_penalty"),
            column("presence_penalty"),
        )

    def apply(self, logits: torch.Tensor) -> None:
        """Repetition (HF-style: a seen token's positive logit is divided by the penalty, a negative one
        multiplied), then frequency (minus penalty x count) and presence (minus a flat penalty), in place.
        A row's neutral coefficients leave its logits bit-for-bit unchanged.

        With a penalty p >= 1, x / p <= x * p exactly when x > 0 (and rounding keeps the order), so the HF
        rule is the elementwise minimum of the two (the maximum when p <= 1): no per-element branch."""
        rows = self.pool_rows.numel()
        first, second = self.pool.scratch(rows)
        sub = (
            logits
            if self.all_rows
            else torch.index_select(logits, 0, self.batch_rows, out=self.pool.gathered(rows))
        )
        if self.repetition is not None:
            factor = torch.index_select(self.pool.rep_factor, 0, self.pool_rows, out=first)
            divided = torch.div(sub, factor, out=second)
            multiplied = factor.mul_(sub)
            if self.repetition == "min":
                torch.minimum(divided, multiplied, out=sub)
            elif self.repetition == "max":
                torch.maximum(divided, multiplied, out=sub)
            else:  # penalties on both sides of 1 in one batch: rare, the plain rule
                sub.copy_(torch.where(sub > 0, divided, multiplied))
        if self.frequency is not None or self.presence is not None:
            counts = torch.index_select(self.pool.counts, 0, self.pool_rows, out=first)
            if self.frequency is not None:
                sub.addcmul_(counts, self.frequency, value=-1.0)
            if self.presence is not None:
                sub.sub_(counts.clamp_(max=1.0).mul_(self.presence))  # presence x (count > 0)
        if not self.all_rows:
            logits[self.batch_rows] = sub

    def record(self, next_ids: torch.Tensor) -> None:
        """Count the tokens just sampled (`next_ids`: one per batch row)."""
        self.pool.add_tokens(self.pool_rows, next_ids[self.batch_rows])


@dataclass
class _Context:
    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    penalty_row: int | None = None


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    input_ids: list[list[int]],
    output_ids: list[list[int]],
) -> None:
    """The penalties computed from scratch from each row's whole context (a throwaway pool): the reference
    the incremental state must equal, and the path of one-off sampling calls."""
    rows = [_Context(p, i, o) for p, i, o in zip(params, input_ids, output_ids, strict=True)]
    penalties = BatchPenalties.build(PenaltyPool(logits.shape[-1], logits.device), rows)
    if penalties is not None:
        penalties.apply(logits)


def banned_token_ids(params: SamplingParams, eos_token_ids: list[int]) -> list[int]:
    """Tokens a row may not sample while it has fewer than min_new_tokens outputs."""
    return eos_token_ids + params.stop_token_ids


def apply_min_new_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_ids: list[list[int]],
    eos_token_ids: list[int],
) -> None:
    """Forbid EOS and the request's stop token ids while it has fewer than min_new_tokens outputs."""
    active = [i for i, p in enumerate(params) if min_new_tokens_active(p, len(output_ids[i]))]
    mask_tokens(logits, active, [banned_token_ids(params[i], eos_token_ids) for i in active])


def mask_tokens(logits: torch.Tensor, rows: list[int], token_lists: list[Sequence[int]]) -> None:
    """Set logits[row, token] to -inf for each listed token inside the vocabulary."""
    if not rows:
        return
    vocab_size = logits.shape[-1]
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.int64)
    keep = (tokens >= 0) & (tokens < vocab_size)
    logits[row_ids[keep].to(logits.device), tokens[keep].to(logits.device)] = float("-inf")
