"""Turns a batch of last-position logits into next tokens, one set of sampling parameters per row.

Order per row: penalties -> logit_bias -> min_new_tokens mask -> temperature -> top_k -> top_p -> min_p -> sample.
Greedy rows (temperature below `GREEDY_TEMPERATURE`, or top_k 1) take the argmax of the penalized logits.
Sampling inverts the row's CDF at one uniform draw: one random number per row instead of one per vocabulary
entry (per-token noise costs more than the rest of the step on a CPU). A request with its own generator draws
its number alone, so a seeded request's tokens do not depend on what else is in the batch.
Log-probabilities are those of the raw model distribution (before penalties and temperature).

The per-row parameters become tensors once per batch (`SamplingBatch`, rebuilt only when the batch
changes); a decode step builds no parameter tensor. Everything that depends on a request's parameters
(penalties, masks, temperature, top-k/top-p/min-p, the top-logprobs count) runs before the random draws: a
batch that raises has consumed no generator's numbers, so the scheduler can retry it row by row and the rows
that do not fail get exactly the tokens they would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.sampling.penalties import PenalizedRow, PenaltyPool, mask_tokens
from srt.sampling.token_filters import greedy_ids

if TYPE_CHECKING:
    from srt.constrained.bitmask import GrammarMask
    from srt.sampling.sampling_batch import SamplingBatch


@dataclass
class SampleOutput:
    next_token_ids: list[int]
    token_logprobs: list[float] | None  # chosen token's logprob under log_softmax(raw logits)
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, its params.logprobs best (id, logprob)


def make_generator(seed: int | None, default: torch.Generator) -> torch.Generator:
    """A request's own generator when it has a seed, else the shared one."""
    if seed is None:
        return default
    generator = torch.Generator(device=default.device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Stateless but for the penalty pool: everything about a batch's parameters lives in its
    `SamplingBatch`, built when the batch changes (`SamplingBatch.build`) and reused while it does not."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: str = "cpu"):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.penalty_pool = PenaltyPool(vocab_size, device)

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch, grammar_mask: GrammarMask | None = None
    ) -> SampleOutput:
        """`grammar_mask`: the structured-output rows' allowed tokens, applied last before the draw."""
        logits = logits[:, : self.vocab_size].float()
        min_new_rows = batch.active_min_new_rows()
        masked = grammar_mask is not None
        if batch.plain and not (min_new_rows or masked):
            return SampleOutput(greedy_ids(logits).tolist(), None, None)

        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.logprob_ks is not None else None
        tops = top_logprobs(raw_logprobs, batch.logprob_ks) if raw_logprobs is not None else None
        if batch.penalties is not None or batch.bias is not None or min_new_rows or masked:
            logits = logits.clone()  # the caller's tensor stays as the model produced it
        if batch.penalties is not None:
            batch.penalties.apply(logits)
        if batch.bias is not None:
            row_ids, tokens, values = batch.bias
            logits.index_put_((row_ids, tokens), values, accumulate=True)
        if min_new_rows:
            mask_tokens(logits, min_new_rows, [batch.banned[i] for i in min_new_rows])
        if masked:
            grammar_mask.apply(logits)  # one masked fill over the constrained rows

        if batch.random is None:
            next_ids = greedy_ids(logits)
        elif batch.greedy_rows is None:
            next_ids = batch.random.sample(logits)
        else:
            next_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            next_ids[batch.greedy_rows] = greedy_ids(logits[batch.greedy_rows])
            next_ids[batch.random.rows] = batch.random.sample(logits[batch.random.rows])
        if batch.penalties is not None:
            batch.penalties.record(next_ids)

        if raw_logprobs is None:
            return SampleOutput(next_ids.tolist(), None, None)
        token_logprobs = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
        return SampleOutput(next_ids.tolist(), token_logprobs, tops)

    def release(self, row: PenalizedRow) -> None:
        """The request left the running batch: give back its penalty row (it rebuilds one if it resumes)."""
        if row.penalty_row is not None:
            self.penalty_pool.release(row.penalty_row)
            row.penalty_row = None


def top_logprobs(raw_logprobs: torch.Tensor, ks: list[int]) -> list[list[tuple[int, float]]]:
    """Per row, its `params.logprobs` best (id, logprob) pairs."""
    max_k = max(ks)
    if max_k == 0:
        return [[] for _ in ks]
    values, indices = raw_logprobs.topk(max_k, dim=-1)
    values, indices = values.tolist(), indices.tolist()
    return [list(zip(indices[i][:k], values[i][:k], strict=True)) for i, k in enumerate(ks)]
