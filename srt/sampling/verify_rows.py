"""A speculative verify step's sampling: each drafting request's parameters expanded to its rows.

Layout: request i fed its newest token and its k_i drafts, so the target produced its k_i + 1 rows of logits,
packed request after request; row j comes after the request's output and its first j drafts, and is the
distribution its j-th token of the step is chosen from.

What a row goes through is what the sampler does to a plain step's one row (sampler.py), each after its own
context: penalties counted over the output and the drafts before the row (computed from that context, as the
sampler's reference does), the end-of-sequence and stop token ban while that context is shorter than
min_new_tokens, then `logit_bias`; a sampled request's rows then go through temperature and
top-k/top-p/min-p (`RandomRows.probs`), which verification draws against (srt/speculative/verify.py), and a
greedy request's verification takes the argmax of its processed rows. Logprobs are read off the raw rows, as
a plain step reads them off its one row; the penalty pool then counts the appended tokens.

`verify_targets` does everything that depends on a request's parameters and draws no random number: a batch
that raises has consumed no generator's numbers, so the scheduler retries it request by request
(`IsolatingSampler.verify`) and the requests that do not fail get exactly the tokens they would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.sampling.penalties import apply_penalties, banned_token_ids, mask_tokens, uses_penalties
from srt.sampling.sampler import top_logprobs
from srt.sampling.sampling_batch import SamplingBatch, SamplingRow

if TYPE_CHECKING:
    from srt.sampling.penalties import PenaltyPool
    from srt.sampling.sampler import Sampler

# one request's run: each token's logprob, and each token's top alternatives ((id, logprob) pairs)
RunLogprobs = tuple[list[float], list[list[tuple[int, float]]]]


@dataclass
class VerifyTargets:
    """What verification judges a step's drafts against (`srt.speculative.verify.verify`'s arguments)."""

    logits: torch.Tensor  # [rows, vocab] processed: greedy requests take their argmax
    probs: torch.Tensor | None  # [rows, vocab] the sampled requests' distributions; None when all are greedy
    greedy: list[bool]  # per request
    generators: list[torch.Generator | None]  # per request


def verify_targets(
    logits: torch.Tensor, reqs: Sequence[SamplingRow], drafts: Sequence[list[int]], sampler: Sampler
) -> VerifyTargets:
    """The processed rows of `reqs` (each with its non-empty `drafts`) from their raw `logits`, packed
    request after request. Raises for a request whose parameters cannot be applied, before any random draw."""
    logits = logits[:, : sampler.vocab_size].float()
    params = [r.sampling_params for r in reqs]
    greedy = [p.is_greedy for p in params]
    probs = None
    if any(
        uses_penalties(p) or len(r.output_ids) < p.min_new_tokens for r, p in zip(reqs, params, strict=True)
    ):
        logits = logits.clone()  # the caller's rows stay raw (logprobs read them)
        apply_context_rules(logits, reqs, drafts, sampler.eos_token_ids)
    if not all(greedy) or any(p.logit_bias for p in params):
        per_row = SamplingBatch.build(
            rows_of(reqs, drafts),
            sampler.vocab_size,
            sampler.eos_token_ids,
            sampler.penalty_pool,
            sampler.device,
        )
        if per_row.bias is not None:
            row_ids, tokens, values = per_row.bias
            logits = logits.clone()
            logits.index_put_((row_ids, tokens), values, accumulate=True)
        if per_row.random is not None:
            probs = torch.zeros_like(logits)
            probs[per_row.random.rows] = per_row.random.probs(logits[per_row.random.rows])
    return VerifyTargets(logits, probs, greedy, [r.generator for r in reqs])


def rows_of(reqs: Sequence[SamplingRow], drafts: Sequence[list[int]]) -> list[SamplingRow]:
    """Each request once per row of its run (k_i + 1): a sampling batch over them gives every row its
    request's parameters."""
    return [r for r, ids in zip(reqs, drafts, strict=True) for _ in range(len(ids) + 1)]


def apply_context_rules(
    logits: torch.Tensor, reqs: Sequence[SamplingRow], drafts: Sequence[list[int]], eos_token_ids: list[int]
) -> None:
    """What depends on a row's position in the run, applied in place: row j of a request comes after its
    output and its first j drafts, so its penalties count those tokens, and while that context is shorter
    than min_new_tokens its end of sequence and stop token ids are banned."""
    start = 0
    for req, ids in zip(reqs, drafts, strict=True):
        n, p = len(ids) + 1, req.sampling_params
        rows = logits[start : start + n]
        if uses_penalties(p):
            contexts = [req.output_ids + ids[:j] for j in range(n)]
            apply_penalties(rows, [p] * n, [req.origin_input_ids] * n, contexts)
        short = [j for j in range(n) if len(req.output_ids) + j < p.min_new_tokens]
        if short:
            mask_tokens(rows, short, [banned_token_ids(p, list(eos_token_ids))] * len(short))
        start += n


def run_logprobs(
    logits: torch.Tensor,
    reqs: Sequence[SamplingRow],
    drafts: Sequence[list[int]],
    tokens: Sequence[list[int]],
    vocab_size: int,
) -> list[RunLogprobs | None] | None:
    """For each request that asks for logprobs, its run's tokens' logprobs and top alternatives, read off
    its raw rows as a decode step reads them off its one row (log_softmax of the raw logits): row j of a
    request is the distribution its j-th token of the step was chosen from. None when none asks (a request
    whose sampling failed has no tokens and asks for nothing)."""
    asking = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None and tokens[i]]
    if not asking:
        return None
    starts = [0]
    for d in drafts[:-1]:
        starts.append(starts[-1] + len(d) + 1)
    rows = [starts[i] + j for i in asking for j in range(len(tokens[i]))]
    raw = torch.log_softmax(logits[rows, :vocab_size].float(), dim=-1)
    chosen = torch.tensor([t for i in asking for t in tokens[i]], device=raw.device)
    values = raw.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    ks = [reqs[i].sampling_params.logprobs for i in asking for _ in tokens[i]]
    tops = top_logprobs(raw, ks)
    out: list[RunLogprobs | None] = [None] * len(reqs)
    at = 0
    for i in asking:
        n = len(tokens[i])
        out[i] = (values[at : at + n], tops[at : at + n])
        at += n
    return out


def record_run_penalties(
    pool: PenaltyPool, reqs: Sequence[SamplingRow], tokens: Sequence[list[int]], taken: Sequence[int]
) -> None:
    """Count the tokens a verify step appended to penalized requests in their penalty-pool rows: the
    sampler's incremental state, which their next plain step reads."""
    for req, run, n in zip(reqs, tokens, taken, strict=True):
        if req.penalty_row is None:
            continue  # it acquires its row from its whole context when it next samples plainly
        row = torch.tensor([req.penalty_row], device=pool.device)
        for token in run[:n]:
            pool.add_tokens(row, torch.tensor([token], device=pool.device))
