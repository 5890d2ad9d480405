"""Drafts from OpenAI's Predicted Outputs (`prediction: {"type": "content", "content": ...}`): the request
carries the predicted completion as token ids, and each step drafts its next tokens.

Alignment rule (stateless, recomputed every step from the output so far):
- nothing generated yet: draft the prediction's first k tokens;
- otherwise find the largest n in [min_n, max_n] such that the output's last n tokens occur in the
  prediction; among those occurrences take the one ending closest to where an unedited copy would be (index
  `len(output) - 1`; a tie goes to the earlier), and draft the up to k tokens after it;
- no occurrence of even min_n tokens, or the occurrence ends the prediction: no draft.
An exact copy is thus drafted entirely (its suffix matches at the copy position, which is also the closest).
After an edit the output's tail stops matching; once the model is back on the predicted text, its last
tokens match again just after the changed span, and drafting resumes from there. Preferring the nearest
occurrence keeps repeated lines (closing braces, a repeated block) from pulling the draft to an earlier copy.

Where the prediction drafts nothing (the output has left it: inside an edit, until it realigns), the
request's own prompt and output may still continue the text: NGRAM's lookup over them drafts instead
(`own_tokens`). Replayed on the grounded workload (scripts/spec_replay.py, 2-core AMD EPYC Zen 4): 1.96x of
no speculation against 1.60x for the prediction alone (letting the longer of the two matches win: 1.97x).
`Drafts.from_prediction` says which drafts came from the prediction: only those count as OpenAI's accepted
and rejected prediction tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from srt.speculative.defaults import PREDICTION_DRAFTS_PER_STEP, PREDICTION_MIN_MATCH
from srt.speculative.history import TOKEN_DTYPE
from srt.speculative.lookup import EVERY_MATCH_DRAFTS_K, DraftLength, LookupProposer, longest_suffix_match
from srt.speculative.ngram import NgramProposer
from srt.speculative.proposer import Drafts, SpecRequest


class PredictionRequest(SpecRequest, Protocol):
    prediction_ids: list[int] | None  # the prediction's content tokenized; None: the request has none


def continue_prediction(
    prediction: np.ndarray,
    output_tail: np.ndarray,
    output_len: int,
    min_n: int,
    max_n: int,
    k: int,
    length: DraftLength = EVERY_MATCH_DRAFTS_K,
) -> np.ndarray:
    """The prediction's next up to k tokens after an output of `output_len` tokens ending in `output_tail`
    (its last `max_n` or more tokens), by the alignment rule above."""
    if k <= 0:
        return prediction[:0]
    if output_len == 0:
        return prediction[:k]
    n, ends = longest_suffix_match(prediction, output_tail, min_n, max_n)
    if n == 0:
        return prediction[:0]
    end = int(ends[np.abs(ends - (output_len - 1)).argmin()])
    return prediction[end + 1 : end + 1 + length(n, k)]


@dataclass
class PredictionProposer(LookupProposer):
    min_n: int = PREDICTION_MIN_MATCH  # its own realignment window, not the NGRAM flag's
    k: int = PREDICTION_DRAFTS_PER_STEP
    length: DraftLength = EVERY_MATCH_DRAFTS_K  # no short-match rule (defaults.PREDICTION_MIN_MATCH says why)
    # what drafts where the prediction has nothing: NGRAM over the request's own tokens (None: nothing)
    own_tokens: NgramProposer | None = field(
        default_factory=lambda: NgramProposer(k=PREDICTION_DRAFTS_PER_STEP)
    )
    # each request's prediction as an array, converted once
    predictions: dict[str, np.ndarray] = field(default_factory=dict, init=False, repr=False)

    def propose(self, requests: Sequence[PredictionRequest], max_lens: Sequence[int]) -> Drafts:
        drafts, from_prediction = [], []
        own = self.own_tokens
        for req, limit in zip(requests, max_lens, strict=True):
            k = min(self.k, limit)
            if k <= 0 or not req.prediction_ids:
                drafts.append([])
                from_prediction.append(False)
                continue
            prediction = self.predictions.get(req.rid)
            if prediction is None:
                prediction = self.predictions[req.rid] = np.asarray(req.prediction_ids, dtype=TOKEN_DTYPE)
            tail = np.asarray(req.output_ids[-self.max_n :], dtype=TOKEN_DTYPE)
            found = continue_prediction(
                prediction, tail, len(req.output_ids), self.min_n, self.max_n, k, self.length
            )
            predicted = len(found) > 0
            if predicted or own is None:
                drafts.append(found.tolist())
            else:
                drafts.append(own.propose([req], [limit]).token_ids[0])
            from_prediction.append(predicted)
        return Drafts(drafts, from_prediction=tuple(from_prediction))

    def release(self, rid: str) -> None:
        self.predictions.pop(rid, None)
        if self.own_tokens is not None:
            self.own_tokens.release(rid)
