"""Logit penalties and the min_new_tokens mask, vectorized over the rows that use them.

Each function edits `logits` ([batch, vocab], a tensor the caller owns) in place and touches only the
rows whose request asked for the feature, so a batch of plain requests pays one Python check per row.
"""

from __future__ import annotations

import itertools

import torch

from srt.sampling.sampling_params import SamplingParams

NO_REPETITION_PENALTY = 1.0


def uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != NO_REPETITION_PENALTY or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def min_new_tokens_active(p: SamplingParams, num_output: int) -> bool:
    return num_output < p.min_new_tokens


def _token_index(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs for scattering per-row token lists into a [rows, vocab] tensor."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64, device=device)
    in_vocab = tokens < vocab_size
    return rows[in_vocab], tokens[in_vocab]


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    input_ids: list[list[int]],
    output_ids: list[list[int]],
) -> None:
    """Repetition (HF-style, over prompt + output), then frequency and presence (over output), in place.

    Repetition divides a positive logit by the penalty and multiplies a negative one, for every token
    seen at least once. Frequency subtracts penalty * count; presence subtracts a flat penalty once.
    """
    vocab_size = logits.shape[-1]
    device = logits.device

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != NO_REPETITION_PENALTY]
    if rep_rows:
        rows, tokens = _token_index([input_ids[i] + output_ids[i] for i in rep_rows], vocab_size, device)
        seen = torch.zeros((len(rep_rows), vocab_size), dtype=torch.bool, device=device)
        seen[rows, tokens] = True
        penalty = torch.tensor(
            [params[i].repetition_penalty for i in rep_rows], dtype=logits.dtype, device=device
        ).unsqueeze(1)
        sub = logits[rep_rows]
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[rep_rows] = torch.where(seen, penalized, sub)

    freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if freq_rows:
        rows, tokens = _token_index([output_ids[i] for i in freq_rows], vocab_size, device)
        counts = torch.zeros((len(freq_rows), vocab_size), dtype=logits.dtype, device=device)
        counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=logits.dtype), accumulate=True)
        freq = torch.tensor([params[i].frequency_penalty for i in freq_rows], dtype=logits.dtype, device=device)
        pres = torch.tensor([params[i].presence_penalty for i in freq_rows], dtype=logits.dtype, device=device)
        logits[freq_rows] -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_min_new_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_ids: list[list[int]],
    eos_token_ids: list[int],
) -> None:
    """Forbid EOS and the request's stop token ids while it has fewer than min_new_tokens outputs."""
    active = [i for i, p in enumerate(params) if min_new_tokens_active(p, len(output_ids[i]))]
    if not active:
        return
    banned = [eos_token_ids + params[i].stop_token_ids for i in active]
    rows, tokens = _token_index(banned, logits.shape[-1], logits.device)
    row_ids = torch.tensor(active, dtype=torch.int64, device=logits.device)[rows]
    logits[row_ids, tokens] = float("-inf")
