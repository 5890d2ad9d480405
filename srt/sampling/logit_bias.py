"""OpenAI's `logit_bias`: per request, a bias added to chosen tokens' logits before temperature.

Vectorised over the batch: one flattened (row, token, bias) triple per entry of the rows that have a bias,
built once per sampling batch and added each step with a single `index_put_`. A batch without any bias
never reaches this module.
"""

from __future__ import annotations

import itertools

import torch

from srt.sampling.sampling_params import SamplingParams


def uses_logit_bias(p: SamplingParams) -> bool:
    return bool(p.logit_bias)


def logit_bias_triples(
    params: list[SamplingParams], vocab_size: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(row ids, token ids, biases) of every entry of the rows that have a bias, or None. A token id
    outside the vocabulary raises (the HTTP layer refuses it; the scheduler isolates a request that
    bypassed it)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return None
    biases = [params[i].logit_bias for i in rows]
    counts = torch.tensor([len(b) for b in biases], dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts)
    tokens = torch.tensor(list(itertools.chain.from_iterable(biases)), dtype=torch.int64)
    values = torch.tensor(
        list(itertools.chain.from_iterable(b.values() for b in biases)), dtype=torch.float32
    )
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
    return row_ids.to(device), tokens.to(device), values.to(device)
