"""Lossless verification of one verify step: which drafts the target model accepts, and the one token after.

Layout: request i fed its last accepted token plus its k_i drafts, so the target produced k_i + 1 rows,
packed request after request (`DraftBatch.row_starts`); row j is the target's distribution for the token
after draft j - 1, i.e. for draft j, and row k_i for the bonus token. Rows arrive already processed by the
sampling pipeline (penalties, bias, temperature, top-k/top-p/min-p), so verification samples from them as
they are; a row may be unnormalized (filtered tokens set to 0, the rest not rescaled).

Greedy: accept drafts while each equals its row's argmax; the next token is the argmax of the first row not
accepted (or of the bonus row).
Sampled (speculative sampling): accept draft x with probability min(1, p(x) / q(x)); at the first rejection
sample the next token from normalize(max(p - q, 0)), the recovered-token rule; if every draft was accepted,
sample the bonus token from p. The emitted tokens are then distributed exactly as tokens sampled from p one
by one. Lookup drafts are point masses (q(x) = 1): acceptance is p(x) and the residual is p without x.

The accepted count is always the length of the accepted prefix: a later position that would have passed its
test after an earlier rejection is not accepted, and per-position acceptance derives from that count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from srt.sampling.token_filters import generator_groups, greedy_ids, sample_from_probs

FINAL_DRAW = 0  # column of a row's uniforms that samples the next token; columns 1.. test drafts 0..


@dataclass(frozen=True)
class DraftBatch:
    """One step's drafts: each request's ids and where its target rows begin in the packed rows. The greedy
    rule reads these lists; the tensors, which only speculative sampling reads, are made on first use (a
    verify step's few small tensor ops, run right after the forward, took ~0.4 ms of a ~10 ms step)."""

    token_ids: list[list[int]]
    starts: list[int]  # per request: index of its first row in the packed target rows
    device: torch.device

    @classmethod
    def build(cls, token_ids: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> DraftBatch:
        starts, row = [], 0
        for ids in token_ids:
            starts.append(row)
            row += len(ids) + 1
        return cls([list(ids) for ids in token_ids], starts, torch.device(device))

    @property
    def num_requests(self) -> int:
        return len(self.token_ids)

    @property
    def width(self) -> int:
        """K, the longest draft."""
        return max((len(ids) for ids in self.token_ids), default=0)

    @property
    def num_rows(self) -> int:
        """Target rows the step produced: k_i + 1 per request."""
        return sum(len(ids) + 1 for ids in self.token_ids)

    @functools.cached_property
    def draft_ids(self) -> torch.Tensor:
        """int64 [requests, K], padded; padding is never read as a draft."""
        width = self.width
        padded = [ids + [0] * (width - len(ids)) for ids in self.token_ids]
        return torch.tensor(padded, dtype=torch.int64, device=self.device).reshape(len(padded), width)

    @functools.cached_property
    def draft_lens(self) -> torch.Tensor:
        return torch.tensor([len(ids) for ids in self.token_ids], dtype=torch.int64, device=self.device)

    @functools.cached_property
    def row_starts(self) -> torch.Tensor:
        return torch.tensor(self.starts, dtype=torch.int64, device=self.device)

    def valid(self) -> torch.Tensor:
        """bool [requests, K]: which padded positions hold a draft."""
        return torch.arange(self.width, device=self.device) < self.draft_lens.unsqueeze(1)

    def draft_rows(self) -> torch.Tensor:
        """int64 [requests, K]: the target row that judges each draft (padding points at row_starts)."""
        offsets = torch.arange(self.width, device=self.device)
        return self.row_starts.unsqueeze(1) + torch.where(self.valid(), offsets, 0)

    def select(self, requests: Sequence[int]) -> DraftBatch:
        """The requests at `requests`, still pointing into the same packed target rows."""
        return DraftBatch(
            [self.token_ids[i] for i in requests], [self.starts[i] for i in requests], self.device
        )


@dataclass(frozen=True)
class VerifyResult:
    drafts: list[list[int]]  # per request, as verified
    accepted: list[int]  # per request: length of the accepted prefix of its drafts
    next_ids: list[int]  # per request: the token after the accepted drafts (bonus or recovered)

    def token_ids(self) -> list[list[int]]:
        """Per request, the tokens to append: its accepted drafts, then `next_ids`."""
        return [
            ids[:n] + [nxt] for ids, n, nxt in zip(self.drafts, self.accepted, self.next_ids, strict=True)
        ]


def accepted_prefix(passed: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Length of each row's leading run of positions that passed (and hold a draft)."""
    return (passed & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)


def verify_greedy(batch: DraftBatch, target_ids: Sequence[int]) -> VerifyResult:
    """`target_ids`: each packed row's argmax."""
    accepted, next_ids = [], []
    for ids, start in zip(batch.token_ids, batch.starts, strict=True):
        n = 0
        while n < len(ids) and ids[n] == target_ids[start + n]:
            n += 1
        accepted.append(n)
        next_ids.append(target_ids[start + n])
    return VerifyResult(batch.token_ids, accepted, next_ids)


def verify_sampled(
    batch: DraftBatch,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """`target_probs`: [rows, vocab] packed target distributions (unnormalized allowed). `uniforms`: U[0, 1)
    [requests, >= K + 1] (`FINAL_DRAW` samples the next token, column 1 + j tests draft j). `draft_probs`:
    [requests, >= K, vocab] normalized draft distributions the drafts were sampled from; None: point masses."""
    width = batch.width
    mass = target_probs.sum(dim=-1)
    rows = batch.draft_rows()
    p_draft = target_probs[rows, batch.draft_ids] / mass[rows]
    if draft_probs is None:
        ratio = p_draft
    else:
        q_draft = draft_probs[:, :width].gather(2, batch.draft_ids.unsqueeze(2)).squeeze(2)
        ratio = p_draft / q_draft.clamp_min(torch.finfo(q_draft.dtype).tiny)
    passed = uniforms[:, 1 : width + 1] < ratio
    accepted = accepted_prefix(passed, batch.valid())

    final_rows = batch.row_starts + accepted
    dist = target_probs[final_rows]  # a copy: becomes the residual in place where a draft was rejected
    rejected = torch.nonzero(accepted < batch.draft_lens).squeeze(1)
    if rejected.numel() > 0:
        at = accepted[rejected]
        if draft_probs is None:
            # max(p - onehot(x), 0) is p without x, and has mass left: x was rejected, so p(x) < 1
            dist[rejected, batch.draft_ids[rejected, at]] = 0.0
        else:
            p_rejected = dist[rejected] / mass[final_rows[rejected]].unsqueeze(1)
            residual = (p_rejected - draft_probs[rejected, at]).clamp_min(0.0)
            # Float rounding can leave no residual mass where p == q; p itself is then exact.
            has_mass = residual.sum(dim=-1) > 0
            dist[rejected[has_mass]] = residual[has_mass]
    next_ids = sample_from_probs(dist, uniforms[:, FINAL_DRAW])
    return VerifyResult(batch.token_ids, accepted.tolist(), next_ids.tolist())


def draw_uniforms(batch: DraftBatch, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """U[0, 1) [requests, K + 1] for `verify_sampled`. Requests sharing a generator draw in one call; a
    request with its own (seeded) generator draws only its own k_i + 1 numbers, so its stream does not depend
    on the other requests' draft lengths."""
    device = batch.device
    uniforms = torch.zeros(batch.num_requests, batch.width + 1, device=device)
    lens = [len(ids) for ids in batch.token_ids]
    for gen, rows in generator_groups(list(generators), device):
        width = max(lens[r] for r in rows.tolist()) + 1
        uniforms[rows, :width] = torch.rand(rows.numel(), width, generator=gen, device=device)
    return uniforms


def verify(
    batch: DraftBatch,
    target_logits: torch.Tensor | None,
    target_probs: torch.Tensor | None,
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """One step of a batch that may mix greedy and sampled requests (`greedy`, per request).

    `target_logits`: [rows, vocab] processed logits, whose argmax greedy requests take as the sampler does
    (None when no request is greedy); `target_probs`: [rows, vocab] processed distributions, read only for
    the other requests' rows (None when all are greedy). `generators`: one per request; only sampled
    requests draw from theirs."""
    sampled = [i for i, g in enumerate(greedy) if not g]
    if len(sampled) == batch.num_requests:
        return verify_sampled(batch, target_probs, draw_uniforms(batch, generators), draft_probs)
    result = verify_greedy(batch, greedy_ids(target_logits).tolist())
    if not sampled:
        return result
    part = batch.select(sampled)
    q = draft_probs[torch.tensor(sampled, device=batch.device)] if draft_probs is not None else None
    drawn = verify_sampled(part, target_probs, draw_uniforms(part, [generators[i] for i in sampled]), q)
    accepted, next_ids = list(result.accepted), list(result.next_ids)
    for j, i in enumerate(sampled):
        accepted[i], next_ids[i] = drawn.accepted[j], drawn.next_ids[j]
    return VerifyResult(batch.token_ids, accepted, next_ids)
