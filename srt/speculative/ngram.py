"""NGRAM: prompt lookup over a request's own tokens (vLLM's rule, SGLang's flag names).

Rule: take the largest n in [min_n, max_n] such that the request's last n tokens also occur earlier in its
prompt + output, at the earliest such occurrence (occurrences may overlap the suffix itself), and propose the
up to k tokens that follow it (fewer after a short match: `DraftLength`), fewer where the history ends. No
such n: no draft.

Cost per step and request: the history array is kept incrementally (`TokenHistories`), and the search is one
vectorized pass over it (`longest_suffix_match`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from srt.speculative.history import TokenHistories
from srt.speculative.lookup import EVERY_MATCH_DRAFTS_K, DraftLength, LookupProposer, longest_suffix_match
from srt.speculative.proposer import Drafts, SpecRequest


def prompt_lookup(
    tokens: np.ndarray, min_n: int, max_n: int, k: int, length: DraftLength = EVERY_MATCH_DRAFTS_K
) -> np.ndarray:
    """The up to `length(n, k)` tokens that follow the earliest earlier occurrence of the longest matching
    suffix (n tokens)."""
    if k <= 0 or len(tokens) < 2:
        return tokens[:0]
    n, ends = longest_suffix_match(tokens[:-1], tokens, min_n, max_n)
    if n == 0:
        return tokens[:0]
    start = int(ends[0]) + 1
    return tokens[start : start + length(n, k)]


@dataclass
class NgramProposer(LookupProposer):
    histories: TokenHistories = field(default_factory=TokenHistories, init=False, repr=False)

    def propose(self, requests: Sequence[SpecRequest], max_lens: Sequence[int]) -> Drafts:
        drafts = []
        for req, limit in zip(requests, max_lens, strict=True):
            k = min(self.k, limit)
            found = (
                prompt_lookup(self.histories.get(req), self.min_n, self.max_n, k, self.length)
                if k > 0
                else None
            )
            drafts.append(found.tolist() if found is not None else [])
        return Drafts(drafts)

    def release(self, rid: str) -> None:
        self.histories.release(rid)
