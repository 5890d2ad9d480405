"""Turns a batch of last-position logits into next tokens, one set of sampling parameters per row.

Order per row: penalties -> min_new_tokens mask -> temperature -> top_k -> top_p -> min_p -> sample.
Greedy rows take the argmax of the penalized logits. Sampling is an exponential race,
argmax(probs / E) with E ~ Exp(1) i.i.d., which draws exactly from `probs`; a request with its own
generator draws its E alone, so a seeded request's tokens do not depend on what else is in the batch.
Log-probabilities are those of the raw model distribution (before penalties and temperature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.sampling.penalties import apply_min_new_tokens, apply_penalties, min_new_tokens_active, uses_penalties
from srt.sampling.sampling_params import SamplingParams

TOP_K_DISABLED = -1
TOP_P_DISABLED = 1.0


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
    ) -> SampleOutput:
        logits = logits[:, : self.vocab_size].float()
        want_logprobs = any(p.logprobs is not None for p in params)
        penalized = any(uses_penalties(p) for p in params)
        min_new = any(min_new_tokens_active(p, len(out)) for p, out in zip(params, output_ids, strict=True))
        greedy = [p.is_greedy for p in params]
        if all(greedy) and not (penalized or min_new or want_logprobs):
            return SampleOutput(logits.argmax(dim=-1).tolist(), None, None)

        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = logits.clone()
        if penalized:
            apply_penalties(logits, params, input_ids, output_ids)
        if min_new:
            apply_min_new_tokens(logits, params, output_ids, self.eos_token_ids)

        next_ids = torch.empty(len(params), dtype=torch.int64, device=logits.device)
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if greedy_rows:
            next_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
        if random_rows:
            next_ids[random_rows] = self._sample_rows(
                logits[random_rows], [params[i] for i in random_rows], [generators[i] for i in random_rows]
            )

        if raw_logprobs is None:
            return SampleOutput(next_ids.tolist(), None, None)
        token_logprobs, top_logprobs = self._logprobs(raw_logprobs, next_ids, params)
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
        noise = _exponential_noise(probs.shape, generators, probs.device)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        raw_logprobs: torch.Tensor, next_ids: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        token_logprobs = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
        ks = [p.logprobs or 0 for p in params]
        max_k = max(ks)
        if max_k == 0:
            return token_logprobs, [[] for _ in params]
        values, indices = raw_logprobs.topk(max_k, dim=-1)
        values, indices = values.tolist(), indices.tolist()
        top = [list(zip(indices[i][:k], values[i][:k], strict=True)) for i, k in enumerate(ks)]
        return token_logprobs, top


def filtered_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Softmax of temperature-scaled logits with top-k, then top-p, then min-p applied per row.

    Masked tokens get probability exactly 0; the rest are not renormalized (the exponential race does
    not need it). top_p keeps the smallest set of best tokens whose probability reaches top_p.
    """
    vocab_size = logits.shape[-1]
    device = logits.device
    use_top_k = any(k != TOP_K_DISABLED for k in top_k)
    use_top_p = any(p < TOP_P_DISABLED for p in top_p)
    if use_top_k or use_top_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        if use_top_k:
            ks = torch.tensor([k if k != TOP_K_DISABLED else vocab_size for k in top_k], device=device)
            ranks = torch.arange(vocab_size, device=device)
            sorted_logits.masked_fill_(ranks.unsqueeze(0) >= ks.unsqueeze(1), float("-inf"))
        if use_top_p:
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            threshold = torch.tensor(
                [p if p < TOP_P_DISABLED else float("inf") for p in top_p], dtype=logits.dtype, device=device
            )
            sorted_logits.masked_fill_(mass_before >= threshold.unsqueeze(1), float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if any(p > 0.0 for p in min_p):
        floor = torch.tensor(min_p, dtype=probs.dtype, device=device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _exponential_noise(
    shape: torch.Size, generators: list[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """Exp(1) noise; rows sharing a generator draw together, a seeded row draws alone."""
    noise = torch.empty(shape, device=device)
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, gen in enumerate(generators):
        groups.setdefault(id(gen), (gen, []))[1].append(row)
    for gen, rows in groups.values():
        noise[rows] = torch.empty((len(rows), shape[1]), device=device).exponential_(generator=gen)
    # An exact 0 draw would divide by zero; the smallest normal float keeps the race well defined.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
