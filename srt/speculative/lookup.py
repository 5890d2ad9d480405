"""What the lookup proposers (NGRAM, Predicted Outputs) share: their window settings, and the search they run
every step, for where the last tokens of one sequence occur in another.

Vectorized over the whole haystack in a handful of numpy calls: find every position holding the query's last
token, then compare the up to `max_n` tokens before each of those positions with the query's tail in one
gather. Per step this costs one pass over the haystack plus `candidates x max_n` comparisons.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass

import numpy as np

from srt.speculative.defaults import (
    NGRAM_MAX_MATCH_WINDOW_SIZE,
    NGRAM_MIN_MATCH_WINDOW_SIZE,
    NUM_DRAFT_TOKENS,
    SHORT_MATCH_DRAFTS,
    SHORT_MATCH_TOKENS,
    drafts_per_step,
)
from srt.speculative.proposer import Proposer

NO_ENDS = np.empty(0, dtype=np.int64)


def longest_suffix_match(
    haystack: np.ndarray, query: np.ndarray, min_n: int, max_n: int
) -> tuple[int, np.ndarray]:
    """The largest n in [min_n, max_n] such that `query[-n:]` occurs in `haystack`, with the index of the last
    token of every such occurrence, ascending; (0, empty) when not even `min_n` tokens match anywhere.

    Occurrences may overlap each other; the caller decides which one to continue from.
    """
    max_n = min(max_n, len(query))
    if max_n < min_n or len(haystack) < min_n:
        return 0, NO_ENDS
    ends = np.flatnonzero(haystack == query[-1])
    ends = ends[np.searchsorted(ends, min_n - 1) :]  # an occurrence needs min_n tokens before its end
    if ends.size == 0:
        return 0, NO_ENDS
    positions = ends[:, None] - np.arange(max_n)  # row: the candidate's end, then the tokens before it
    same = haystack[np.maximum(positions, 0)] == query[len(query) - max_n :][::-1]
    same &= positions >= 0
    lengths = np.where(same.all(axis=1), max_n, same.argmin(axis=1))  # matched run from the end backwards
    best = int(lengths.max())
    if best < min_n:
        return 0, NO_ENDS
    return best, ends[lengths == best]


@dataclass(frozen=True)
class DraftLength:
    """How many tokens a match of n tokens may draft, of at most k: a match shorter than `short_match` at
    most `short_drafts` (defaults.SHORT_MATCH_TOKENS says why). `short_match` 0: every match drafts k."""

    short_match: int = SHORT_MATCH_TOKENS
    short_drafts: int = SHORT_MATCH_DRAFTS

    def __call__(self, n: int, k: int) -> int:
        return min(k, self.short_drafts) if n < self.short_match else k


EVERY_MATCH_DRAFTS_K = DraftLength(0, 0)


@dataclass
class LookupProposer(Proposer, ABC):
    """A proposer that copies the tokens following a match: suffixes of min_n..max_n tokens anchor it
    (`--speculative-ngram-{min,max}-match-window-size`), and it drafts at most k tokens a step, fewer after
    a short match (`length`)."""

    min_n: int = NGRAM_MIN_MATCH_WINDOW_SIZE
    max_n: int = NGRAM_MAX_MATCH_WINDOW_SIZE
    k: int = drafts_per_step(NUM_DRAFT_TOKENS)
    length: DraftLength = DraftLength()

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"match window needs 1 <= min ({self.min_n}) <= max ({self.max_n})")
        if self.k < 0:
            raise ValueError(f"draft length must be >= 0, got {self.k}")
