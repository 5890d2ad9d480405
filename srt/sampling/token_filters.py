"""The per-row arithmetic of sampling, shared by the sampler and the batch tensors it reads (`SamplingBatch`):
top-k / top-p / min-p filters built once per batch, greedy ids, and one uniform draw per row inverted through
the row's CDF (see `sampler.py` for the order of operations and why one draw per row)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.model_executor.layers import cpu_kernels

TOP_K_DISABLED = -1
TOP_P_DISABLED = 1.0
# How many best tokens to search for the top-p cut-off, widening per row before a full sort: a model's
# next-token distribution almost always puts top_p of its mass inside the first few hundred tokens.
TOP_P_CANDIDATES = (128, 2048)
FLOAT32_MAX = torch.finfo(torch.float32).max  # sampling runs on float32 logits


@dataclass
class TokenFilters:
    """top-k / top-p / min-p of a set of rows as tensors, built once per batch."""

    top_k: torch.Tensor | None  # int64 [rows, 1]: index of each row's k-th best (k - 1); None: no row cuts
    max_k: int
    top_p_rows: torch.Tensor | None  # int64: rows with top_p < 1; None: no row cuts
    top_p_all: bool
    top_p_share: torch.Tensor | None  # [len(top_p_rows), 1]
    min_p: torch.Tensor | None  # [rows, 1]; None: no row cuts

    @classmethod
    def build(
        cls, top_k: list[int], top_p: list[float], min_p: list[float], vocab_size: int, device
    ) -> TokenFilters:
        k_tensor, max_k = None, 0
        if any(k != TOP_K_DISABLED for k in top_k):
            ks = [min(k, vocab_size) if k != TOP_K_DISABLED else vocab_size for k in top_k]
            k_tensor = torch.tensor(ks, dtype=torch.int64, device=device).unsqueeze(1) - 1
            max_k = max(ks)
        p_rows = [i for i, p in enumerate(top_p) if p < TOP_P_DISABLED]
        share = torch.tensor([top_p[i] for i in p_rows], device=device).unsqueeze(1) if p_rows else None
        floor = None
        if any(p > 0.0 for p in min_p):
            floor = torch.tensor(min_p, device=device).unsqueeze(1)
        return cls(
            k_tensor,
            max_k,
            torch.tensor(p_rows, dtype=torch.int64, device=device) if p_rows else None,
            len(p_rows) == len(top_p),
            share,
            floor,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Softmax of (temperature-scaled) logits with top-k, then top-p, then min-p applied per row."""
        probs = torch.softmax(logits, dim=-1)
        if self.top_k is not None:
            kth = probs.topk(self.max_k, dim=-1).values.gather(1, self.top_k)
            probs.masked_fill_(probs < kth, 0.0)
        if self.top_p_rows is not None:
            _apply_top_p(probs, self.top_p_rows, self.top_p_all, self.top_p_share)
        if self.min_p is not None:
            probs.masked_fill_(probs < self.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs


def filtered_probs(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Softmax of temperature-scaled logits with top-k, then top-p, then min-p applied per row.

    Masked tokens get probability exactly 0 and the rest are not renormalized (sampling scales by the
    row's remaining mass). top_k keeps tokens at least as likely as the k-th best (ties at the boundary
    stay); top_p keeps the smallest set of best tokens whose share of the top-k mass reaches top_p.
    """
    return TokenFilters.build(top_k, top_p, min_p, logits.shape[-1], logits.device).apply(logits)


def _apply_top_p(probs: torch.Tensor, rows: torch.Tensor, all_rows: bool, share: torch.Tensor) -> None:
    """Find each row's cut-off among its best few tokens, widening the search (up to a full sort)
    only for the rows whose candidates do not reach top_p (flat distributions)."""
    sub = probs if all_rows else probs[rows]
    target = share * sub.sum(dim=-1, keepdim=True)
    cutoff = torch.full_like(target, float("nan"))
    pending = torch.arange(rows.numel(), device=probs.device)
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
    # at least the best token: a top_p that float32 holds as 0 (below ~1e-45) keeps no mass otherwise
    num_kept = (mass_before < target).sum(dim=-1, keepdim=True).clamp_(min=1)
    cutoff = best.gather(1, num_kept - 1)
    reached = (mass_before[:, -1:] + best[:, -1:]) >= target
    return cutoff.masked_fill(~reached, float("nan"))


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index (`argmax`'s answer; a NaN wins). On the CPU, fp32 rows go to the C
    kernel (`srt_argmax_rows`): torch's reduction took 0.47 ms for the 17 rows of a verify step over
    SmolLM2's 49k vocabulary, the kernel 0.05. Elsewhere `max(dim)`, which measured 2.8x faster than
    `argmax` on the CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] > 0:
        kernels = cpu_kernels.load()
        if kernels is not None:
            return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


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


def generator_groups(
    generators: list[torch.Generator | None], device
) -> list[tuple[torch.Generator | None, torch.Tensor]]:
    """Rows sharing a generator draw together (one call); a seeded row draws alone."""
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for row, gen in enumerate(generators):
        groups.setdefault(id(gen), (gen, []))[1].append(row)
    return [(gen, torch.tensor(rows, dtype=torch.int64, device=device)) for gen, rows in groups.values()]


def draw_uniforms(
    groups: list[tuple[torch.Generator | None, torch.Tensor]], num_rows: int, device
) -> torch.Tensor:
    """One U[0, 1) draw per row, group by group in the order the groups were built."""
    uniforms = torch.empty(num_rows, device=device)
    for gen, rows in groups:
        uniforms[rows] = torch.rand(rows.numel(), generator=gen, device=device)
    return uniforms
