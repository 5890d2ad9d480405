"""Turns a batch of last-position logits into next tokens, one set of sampling parameters per row.

Order per row: penalties -> logit_bias -> min_new_tokens mask -> temperature -> top_k -> top_p -> min_p -> sample.
Greedy rows take the argmax of the penalized logits. Sampling inverts the row's CDF at one uniform
draw: one random number per row instead of one per vocabulary entry (per-token noise costs more than
the rest of the step on a CPU). A request with its own generator draws its number alone, so a seeded
request's tokens do not depend on what else is in the batch.
Log-probabilities are those of the raw model distribution (before penalties and temperature).

Everything that depends on a request's parameters (penalties, masks, temperature, top-k/top-p/min-p, the
top-logprobs count) runs before the random draws: a batch that raises has consumed no generator's numbers,
so the scheduler can retry it row by row and the rows that do not fail get exactly the tokens they would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.sampling.logit_bias import apply_logit_bias, uses_logit_bias
from srt.sampling.penalties import (
    apply_min_new_tokens,
    apply_penalties,
    min_new_tokens_active,
    uses_penalties,
)
from srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from srt.constrained.bitmask import GrammarMask

TOP_K_DISABLED = -1
TOP_P_DISABLED = 1.0
# How many best tokens to search for the top-p cut-off, widening per row before a full sort: a model's
# next-token distribution almost always puts top_p of its mass inside the first few hundred tokens.
TOP_P_CANDIDATES = (128, 2048)


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
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: str = "cpu"):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        input_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        grammar_mask: GrammarMask | None = None,
    ) -> SampleOutput:
        """`grammar_mask`: the structured-output rows' allowed tokens, applied last before the draw."""
        logits = logits[:, : self.vocab_size].float()
        want_logprobs = any(p.logprobs is not None for p in params)
        penalized = any(uses_penalties(p) for p in params)
        min_new = any(min_new_tokens_active(p, len(out)) for p, out in zip(params, output_ids, strict=True))
        biased = any(uses_logit_bias(p) for p in params)
        greedy = [p.is_greedy for p in params]
        masked = grammar_mask is not None
        if all(greedy) and not (penalized or biased or min_new or want_logprobs or masked):
            return SampleOutput(logits.argmax(dim=-1).tolist(), None, None)

        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        top_logprobs = self._top_logprobs(raw_logprobs, params) if want_logprobs else None
        if penalized or biased or min_new or masked:
            logits = logits.clone()  # the caller's tensor stays as the model produced it
        if penalized:
            apply_penalties(logits, params, input_ids, output_ids)
        if biased:
            apply_logit_bias(logits, params)
        if min_new:
            apply_min_new_tokens(logits, params, output_ids, self.eos_token_ids)
        if masked:
            grammar_mask.apply(logits)  # one masked fill over the constrained rows

        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if not random_rows:
            next_ids = logits.argmax(dim=-1)
        elif not greedy_rows:
            next_ids = self._sample_rows(logits, params, generators)
        else:
            next_ids = torch.empty(len(params), dtype=torch.int64, device=logits.device)
            next_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
            next_ids[random_rows] = self._sample_rows(
                logits[random_rows], [params[i] for i in random_rows], [generators[i] for i in random_rows]
            )

        if raw_logprobs is None:
            return SampleOutput(next_ids.tolist(), None, None)
        token_logprobs = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
        return SampleOutput(next_ids.tolist(), token_logprobs, top_logprobs)

    def _sample_rows(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        probs = filtered_probs(
            logits / temperature.unsqueeze(1),
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
        )
        return sample_from_probs(probs, _uniforms(generators, probs.device))

    @staticmethod
    def _top_logprobs(
        raw_logprobs: torch.Tensor, params: list[SamplingParams]
    ) -> list[list[tuple[int, float]]]:
        """Per row, its `params.logprobs` best (id, logprob) pairs."""
        ks = [p.logprobs or 0 for p in params]
        max_k = max(ks)
        if max_k == 0:
            return [[] for _ in params]
        values, indices = raw_logprobs.topk(max_k, dim=-1)
        values, indices = values.tolist(), indices.tolist()
        return [list(zip(indices[i][:k], values[i][:k], strict=True)) for i, k in enumerate(ks)]


def filtered_probs(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Softmax of temperature-scaled logits with top-k, then top-p, then min-p applied per row.

    Masked tokens get probability exactly 0 and the rest are not renormalized (sampling scales by the
    row's remaining mass). top_k keeps tokens at least as likely as the k-th best (ties at the boundary
    stay); top_p keeps the smallest set of best tokens whose share of the top-k mass reaches top_p.
    """
    probs = torch.softmax(logits, dim=-1)
    if any(k != TOP_K_DISABLED for k in top_k):
        _apply_top_k(probs, top_k)
    if any(p < TOP_P_DISABLED for p in top_p):
        _apply_top_p(probs, top_p)
    if any(p > 0.0 for p in min_p):
        floor = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1)
        probs.masked_fill_(probs < floor * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _apply_top_k(probs: torch.Tensor, top_k: list[int]) -> None:
    vocab_size = probs.shape[-1]
    ks = [min(k, vocab_size) if k != TOP_K_DISABLED else vocab_size for k in top_k]
    best = probs.topk(max(ks), dim=-1).values
    kth = best.gather(1, torch.tensor(ks, device=probs.device).unsqueeze(1) - 1)
    probs.masked_fill_(probs < kth, 0.0)


def _apply_top_p(probs: torch.Tensor, top_p: list[float]) -> None:
    """Find each row's cut-off among its best few tokens, widening the search (up to a full sort)
    only for the rows whose candidates do not reach top_p (flat distributions)."""
    rows = [i for i, p in enumerate(top_p) if p < TOP_P_DISABLED]
    all_rows = len(rows) == probs.shape[0]
    sub = probs if all_rows else probs[rows]
    share = torch.tensor([top_p[i] for i in rows], dtype=probs.dtype, device=probs.device)
    target = share.unsqueeze(1) * sub.sum(dim=-1, keepdim=True)
    cutoff = torch.full_like(target, float("nan"))
    pending = torch.arange(len(rows), device=probs.device)
    for candidates in (*TOP_P_CANDIDATES, sub.shape[-1]):
        candidates = min(candidates, sub.shape[-1])
        cutoff[pending] = _top_p_cutoff(sub[pending], target[pending], candidates)
        pending = pending[torch.isnan(cutoff[pending].squeeze(1))]
        if pending.numel() == 0 or candidates == sub.shape[-1]:
            break
    sub.masked_fill_(sub < cutoff, 0.0)
    if not all_rows:
        probs[rows] = sub


def _top_p_cutoff(probs: torch.Tensor, target: torch.Tensor, candidates: int) -> torch.Tensor:
    """Probability of the last token kept per row ([rows, 1]); NaN where the candidates fall short."""
    best = probs.topk(candidates, dim=-1).values
    mass_before = torch.cumsum(best, dim=-1) - best
    num_kept = (mass_before < target).sum(dim=-1, keepdim=True)
    cutoff = best.gather(1, num_kept - 1)
    reached = (mass_before[:, -1:] + best[:, -1:]) >= target
    return cutoff.masked_fill(~reached, float("nan"))


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Invert each row's (unnormalized) CDF at its uniform draw; zero-probability tokens are never chosen."""
    cdf = torch.cumsum(probs, dim=-1)
    point = uniforms.unsqueeze(1) * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, point, right=True).squeeze(1)
    overshoot = chosen >= probs.shape[-1]
    if overshoot.any():
        # Rounding put the point at the very end of the CDF; the most likely token is a safe landing.
        chosen[overshoot] = probs[overshoot].argmax(dim=-1)
    return chosen


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row; rows sharing a generator draw together, a seeded row draws alone."""
    uniforms = torch.empty(len(generators), device=device)
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, gen in enumerate(generators):
        groups.setdefault(id(gen), (gen, []))[1].append(row)
    for gen, rows in groups.values():
        uniforms[rows] = torch.rand(len(rows), generator=gen, device=device)
    return uniforms
