"""The interface every proposer implements, and what it hands the verify step.

Contract: the scheduler calls `propose` once per decode step with the running requests that may speculate
and, per request, the most drafts it may take this step (`draft_len_limit`); it gets back one draft per
request, in the same order, possibly empty. A proposer may keep per-request state between steps (keyed by
`rid`, valid while the request's tokens only grow); the scheduler calls `release(rid)` when a request leaves
for good (finished or aborted), not when it is retracted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class SpecRequest(Protocol):
    """What a proposer reads of a request: srt's `Req` has these attributes as they are."""

    rid: str
    origin_input_ids: list[int]  # the prompt
    output_ids: list[int]  # every token accepted so far; only grows while the request runs


@dataclass(frozen=True)
class Drafts:
    """One step's drafts, one list per request in the order asked (empty: that request decodes plainly).

    `probs` is the draft distribution q the tokens were sampled from ([requests, max_len, vocab], rows past a
    request's length unused), from a draft model; None means every draft is a point mass (q(x) = 1), as for
    lookup proposers.
    """

    token_ids: list[list[int]]
    probs: torch.Tensor | None = None
    # per request, whether its drafts came from its `prediction` (OpenAI's accepted / rejected prediction
    # tokens count only those); None: none did
    from_prediction: tuple[bool, ...] | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.token_ids]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: Sequence[SpecRequest], max_lens: Sequence[int]) -> Drafts:
        """At most `max_lens[i]` drafts for `requests[i]`, continuing its tokens (prompt + output)."""

    @abstractmethod
    def release(self, rid: str) -> None:
        """Forget what is kept for `rid` (its request finished or was aborted)."""


def draft_len_limit(k: int, tokens_left: int) -> int:
    """Drafts a request may take this step: a verify step appends the accepted drafts plus one more token, so
    `tokens_left` (the fewer of max_new_tokens left and room left in the context) allows `tokens_left - 1`."""
    return max(min(k, tokens_left - 1), 0)
