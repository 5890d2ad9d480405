"""Logit penalties and the min_new_tokens mask, vectorized over the rows that use them.

Each function edits `logits` ([batch, vocab], a tensor the caller owns) in place and touches only the
(row, token) entries concerned, so a batch of plain requests pays one Python check per row.
"""

from __future__ import annotations

import itertools

import torch

from srt.sampling.sampling_params import SamplingParams

NO_REPETITION_PENALTY = 1.0


def uses_penalties(p: SamplingParams) -> bool:
    return (
        p.repetition_penalty != NO_REPETITION_PENALTY
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


def min_new_tokens_active(p: SamplingParams, num_output: int) -> bool:
    return num_output < p.min_new_tokens


def _token_index(
    rows: list[int], token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch row, token) index pairs, one per listed token inside the vocabulary, for indexing a [batch, vocab]
    tensor (a negative id would otherwise index from the end). A list that is no list of 64-bit ints raises."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64, device=device)
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64, device=device), lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64, device=device)
    in_vocab = (tokens >= 0) & (tokens < vocab_size)
    return row_ids[in_vocab], tokens[in_vocab]


def _unique_pairs(
    rows: torch.Tensor, tokens: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    flat = torch.unique(rows * vocab_size + tokens)
    return flat // vocab_size, flat % vocab_size


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    input_ids: list[list[int]],
    output_ids: list[list[int]],
) -> None:
    """Repetition (HF-style, over prompt + output), then frequency and presence (over output), in place.

    Repetition divides a positive logit by the penalty and multiplies a negative one, for every token
    seen at least once. Frequency subtracts penalty * count; presence subtracts a flat penalty once.
    Work is proportional to the number of tokens seen, not to the vocabulary.
    """
    vocab_size = logits.shape[-1]
    device = logits.device

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != NO_REPETITION_PENALTY]
    if rep_rows:
        seen = [input_ids[i] + output_ids[i] for i in rep_rows]
        rows, tokens = _unique_pairs(*_token_index(rep_rows, seen, vocab_size, device), vocab_size)
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device)[
            rows
        ]
        values = logits[rows, tokens]
        logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)

    freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0]
    if freq_rows:
        rows, tokens = _token_index(freq_rows, [output_ids[i] for i in freq_rows], vocab_size, device)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)
        logits.index_put_((rows, tokens), -freq[rows], accumulate=True)

    pres_rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0]
    if pres_rows:
        pairs = _token_index(pres_rows, [output_ids[i] for i in pres_rows], vocab_size, device)
        rows, tokens = _unique_pairs(*pairs, vocab_size)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)
        logits[rows, tokens] -= pres[rows]


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
    rows, tokens = _token_index(active, banned, logits.shape[-1], logits.device)
    logits[rows, tokens] = float("-inf")
