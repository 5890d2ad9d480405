"""Per-request speculative decoding figures, and one step's totals for the counters: plain integers that the
scheduler updates once per verify step, from which SGLang's `meta_info` fields and vLLM's per-request block
are derived on demand.

Definitions (k = drafts a request was given in a step, a = how many of them were accepted, a <= k):
- a *spec step* is a verify step in which the request had k >= 1. A step in which it had no draft is a plain
  decode step and counts nowhere here, nor does the token its prefill produced;
- `verify_steps` (SGLang `spec_verify_ct`, vLLM `num_spec_steps`): spec steps;
- `draft_tokens` (SGLang `spec_num_proposed_drafts`, vLLM `num_draft_tokens`): sum of k;
- `accepted_tokens` (SGLang `spec_num_correct_drafts`, vLLM `num_accepted_draft_tokens`): sum of a; the bonus
  or recovered token each step also emits is not a draft and is not counted;
- `accepted_histogram` (SGLang `spec_correct_drafts_histogram`, vLLM `acceptance_histogram`): entry a counts
  the spec steps that accepted exactly a drafts; it sums to `verify_steps`;
- accept length (SGLang `spec_accept_length`, vLLM `mean_acceptance_length`) = 1 + accepted / verify_steps:
  tokens emitted per spec step. SGLang divides all completion tokens by its verify count, which counts the
  prefill's token as if a step had emitted it; srt does not;
- accept rate (SGLang `spec_accept_rate`, vLLM `draft_acceptance_rate`) = accepted / draft_tokens, in [0, 1].
Both ratios are None before the first spec step.
- `prediction_draft_tokens` and `prediction_accepted_tokens`: the part of `draft_tokens` and `accepted_tokens`
  whose drafts came from the request's `prediction` (a request with one may also draft from its own tokens);
  OpenAI's `accepted_prediction_tokens` and `rejected_prediction_tokens` are made of these alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class SpecRequestStats:
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    prediction_draft_tokens: int = 0
    prediction_accepted_tokens: int = 0

    def record(self, num_drafts: int, num_accepted: int, from_prediction: bool = False) -> None:
        """One verify step's outcome for this request (a step with no draft changes nothing);
        `from_prediction`: its drafts came from the request's prediction."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        if num_drafts == 0:
            return
        self.verify_steps += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        if from_prediction:
            self.prediction_draft_tokens += num_drafts
            self.prediction_accepted_tokens += num_accepted
        if len(self.accepted_histogram) <= num_accepted:
            self.accepted_histogram.extend([0] * (num_accepted + 1 - len(self.accepted_histogram)))
        self.accepted_histogram[num_accepted] += 1

    def add(self, other: SpecRequestStats) -> None:
        """Add another request's figures (a response's choices, summed)."""
        self.verify_steps += other.verify_steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.prediction_draft_tokens += other.prediction_draft_tokens
        self.prediction_accepted_tokens += other.prediction_accepted_tokens
        hist = other.accepted_histogram
        if len(self.accepted_histogram) < len(hist):
            self.accepted_histogram.extend([0] * (len(hist) - len(self.accepted_histogram)))
        for a, count in enumerate(hist):
            self.accepted_histogram[a] += count

    @property
    def accept_length(self) -> float | None:
        return 1 + self.accepted_tokens / self.verify_steps if self.verify_steps else None

    @property
    def accept_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def sglang_meta_info(self) -> dict:
        """SGLang's per-request `meta_info` fields, srt's accept length (see the module docstring)."""
        return {
            "spec_verify_ct": self.verify_steps,
            "spec_accept_length": self.accept_length,
            "spec_accept_rate": self.accept_rate,
            "spec_num_correct_drafts": self.accepted_tokens,
            "spec_num_proposed_drafts": self.draft_tokens,
            "spec_correct_drafts_histogram": list(self.accepted_histogram),
        }

    def vllm_block(self) -> dict:
        """vLLM's per-request speculative decoding block."""
        return {
            "num_spec_steps": self.verify_steps,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_draft_tokens": self.accepted_tokens,
            "mean_acceptance_length": self.accept_length,
            "draft_acceptance_rate": self.accept_rate,
            "acceptance_histogram": list(self.accepted_histogram),
        }

    def prediction_usage(self) -> dict:
        """OpenAI's `completion_tokens_details` for a request with a prediction: accepted are the prediction's
        tokens the model confirmed, rejected those it computed and threw away (drafts from the request's own
        tokens are neither)."""
        return {
            "accepted_prediction_tokens": self.prediction_accepted_tokens,
            "rejected_prediction_tokens": self.prediction_draft_tokens - self.prediction_accepted_tokens,
        }


@dataclass(frozen=True)
class SpecStepStats:
    """One verify step's totals for the counters, built from the same numbers the requests record, so that
    the per-request sums equal the counters (`spec_decode_num_*_total`)."""

    num_drafts: int  # requests with at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # entry j: requests that accepted draft j; never increases with j
    # the part of the two token counts whose drafts came from requests' `prediction` (OpenAI's usage fields)
    num_prediction_draft_tokens: int = 0
    num_accepted_prediction_tokens: int = 0

    @classmethod
    def from_counts(
        cls, draft_lens: Sequence[int], accepted: Sequence[int], predicted: Sequence[bool] | None = None
    ) -> SpecStepStats:
        """`predicted[i]`: request i drafted from its prediction (default: none did)."""
        per_position = [0] * max(draft_lens, default=0)
        for k, a in zip(draft_lens, accepted, strict=True):
            if not 0 <= a <= k:
                raise ValueError(f"accepted {a} of {k} drafts")
            for j in range(a):
                per_position[j] += 1
        predicted = predicted or [False] * len(draft_lens)
        return cls(
            num_drafts=sum(1 for k in draft_lens if k > 0),
            num_draft_tokens=sum(draft_lens),
            num_accepted_tokens=sum(accepted),
            accepted_per_position=tuple(per_position),
            num_prediction_draft_tokens=sum(k for k, p in zip(draft_lens, predicted, strict=True) if p),
            num_accepted_prediction_tokens=sum(a for a, p in zip(accepted, predicted, strict=True) if p),
        )
