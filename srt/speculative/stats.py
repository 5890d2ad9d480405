"""Per-request speculative decoding figures, and one step's totals: plain integers that the scheduler updates
once per verify step, from which SGLang's `meta_info` fields, vLLM's per-request block, OpenAI's prediction
usage and the server's counters are all derived.

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
- OpenAI's `accepted_prediction_tokens` and `rejected_prediction_tokens` count completion positions, for the
  steps whose drafts came from the request's `prediction` (a request with one may also draft from its own
  tokens): accepted, the positions holding a prediction token the model accepted (that step's a); rejected,
  the positions where the model output its own token instead of the prediction's (1 in a step with a < k).
  The drafts after a rejected one were never judged (the next step drafts those positions anew), so they are
  not rejected tokens: every completion position counts at most once, and accepted + rejected never exceed
  the completion tokens. What the prediction cost is vLLM's `num_draft_tokens - num_accepted_draft_tokens`.

Only positions that end up in the completion count (`SpecStep.cut`): when the output is cut inside a step's
run (a stop token id, EOS or max_tokens in the scheduler; a stop string in the detokenizer, after the step
was counted), the step counts as if it had been given and had accepted only the drafts the completion
holds, and a step wholly past the cut counts nowhere. A request whose output a stop string may still cut
keeps its steps since its last output message (`open_steps`), which is all such a cut can reach.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecStep:
    """One request's spec step: its tokens are the output's `[position, position + accepted + 1)`."""

    position: int  # output index of the step's first token
    drafts: int
    accepted: int
    from_prediction: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.accepted <= self.drafts:
            raise ValueError(f"accepted {self.accepted} of {self.drafts} drafts")

    @property
    def end(self) -> int:
        return self.position + self.accepted + 1

    def cut(self, length: int) -> SpecStep | None:
        """The step as it counts when the output keeps only its first `length` tokens: whole when it ends
        within them, only its drafts before the cut (all accepted) when it straddles it, None past it."""
        if length >= self.end:
            return self
        if length <= self.position:
            return None
        kept = length - self.position
        return dataclasses.replace(self, drafts=kept, accepted=kept)


@dataclass
class SpecRequestStats:
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    prediction_draft_tokens: int = 0  # the part of draft_tokens the prediction gave
    prediction_accepted_tokens: int = 0
    prediction_rejected_tokens: int = 0
    # the steps a stop string may still cut: those since the request's last output message
    open_steps: list[SpecStep] = field(default_factory=list)

    def record(self, step: SpecStep, may_be_cut: bool = False) -> None:
        """One spec step (a step with no draft changes nothing); `may_be_cut`: a stop string may still end
        the output inside it, so it stays open for `truncate`."""
        if step.drafts == 0:
            return
        self._count(step, 1)
        if may_be_cut:
            self.open_steps.append(step)

    def _count(self, step: SpecStep, sign: int) -> None:
        self.verify_steps += sign
        self.draft_tokens += sign * step.drafts
        self.accepted_tokens += sign * step.accepted
        hist = self.accepted_histogram
        if len(hist) <= step.accepted:
            hist.extend([0] * (step.accepted + 1 - len(hist)))
        hist[step.accepted] += sign
        while hist and hist[-1] == 0:
            hist.pop()
        if step.from_prediction:
            self.prediction_draft_tokens += sign * step.drafts
            self.prediction_accepted_tokens += sign * step.accepted
            self.prediction_rejected_tokens += sign * (step.accepted < step.drafts)

    def truncate(self, length: int) -> None:
        """The output was cut to its first `length` tokens: the open steps count only what it kept."""
        kept = []
        for step in self.open_steps:
            cut = step.cut(length)
            if cut is not step:
                self._count(step, -1)
                if cut is not None:
                    self._count(cut, 1)
            if cut is not None:
                kept.append(cut)
        self.open_steps = kept

    def hand_off(self) -> SpecRequestStats:
        """A copy for the request's output message, holding its open steps (the detokenizer cuts them if a
        stop string ends the output inside them); this record closes them, since a later message's cut
        cannot reach them."""
        copy = dataclasses.replace(self, accepted_histogram=list(self.accepted_histogram))
        self.open_steps = []
        return copy

    def add(self, other: SpecRequestStats) -> None:
        """Add another request's figures (a response's choices, summed)."""
        self.verify_steps += other.verify_steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.prediction_draft_tokens += other.prediction_draft_tokens
        self.prediction_accepted_tokens += other.prediction_accepted_tokens
        self.prediction_rejected_tokens += other.prediction_rejected_tokens
        hist = other.accepted_histogram
        if len(self.accepted_histogram) < len(hist):
            self.accepted_histogram.extend([0] * (len(hist) - len(self.accepted_histogram)))
        for a, count in enumerate(hist):
            self.accepted_histogram[a] += count

    @property
    def accepted_per_position(self) -> list[int]:
        """Entry j: spec steps that accepted draft j (accepted more than j drafts); never increases with j."""
        per_position, above = [], 0
        for count in reversed(self.accepted_histogram[1:]):
            above += count
            per_position.append(above)
        return per_position[::-1]

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
        """OpenAI's `completion_tokens_details` for a request with a prediction (the module docstring says
        what each counts: completion positions, so together they never exceed the completion)."""
        return {
            "accepted_prediction_tokens": self.prediction_accepted_tokens,
            "rejected_prediction_tokens": self.prediction_rejected_tokens,
        }


@dataclass(frozen=True)
class SpecStepStats:
    """One verify step's totals over its requests, as they count once the step's own cuts (a stop token id,
    EOS or max_tokens inside a run) are applied: what the scheduler's verify-step log line and gauges read.
    A stop string found later is not in them; the counters, moved by requests' final figures, are exact."""

    num_drafts: int  # requests with at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # entry j: requests that accepted draft j; never increases with j

    @classmethod
    def from_steps(cls, steps: Sequence[SpecStep | None]) -> SpecStepStats:
        """`steps`: each request's step of this verify step (None: nothing of it was output)."""
        counted = [s for s in steps if s is not None and s.drafts > 0]
        per_position = [0] * max((s.drafts for s in counted), default=0)
        for s in counted:
            for j in range(s.accepted):
                per_position[j] += 1
        return cls(
            num_drafts=len(counted),
            num_draft_tokens=sum(s.drafts for s in counted),
            num_accepted_tokens=sum(s.accepted for s in counted),
            accepted_per_position=tuple(per_position),
        )
