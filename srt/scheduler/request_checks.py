"""Why a new request ends before it runs, checked once when the scheduler receives it.

The HTTP layer validates every field first; these checks are the scheduler's own: they depend on what only
it knows (the requests it holds, the KV capacity, the model's vocabulary), and they are the last guard
against a message that did not come through that layer. A value that cannot even be compared (an id that
is not a number) or that the parameters' own `verify()` rejects raises; the caller finishes that request
alone with an error."""

from __future__ import annotations

from srt.io_struct import FinishReason
from srt.scheduler.schedule_batch import Req

# Integer fields of another type (a bool, a float) would fail or not depending on the batch.
INTEGER_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "logprobs")


def refusal(
    req: Req, live: dict[str, Req], max_input_len: int, vocab_size: int, embedding: bool = False
) -> FinishReason | None:
    """`error` for a request that cannot run (duplicate rid, bad prompt, bad parameters), `length` for one
    with nothing to compute, else None. `live`: the requests held now, by rid. `embedding`: an embedding
    server's request, whose prefill is the whole work (it generates nothing)."""
    ids, params = req.origin_input_ids, req.sampling_params
    if req.rid in live:
        return FinishReason("error", message=f"a request with rid {req.rid!r} is already running")
    if not ids:
        return FinishReason("error", message="the prompt is empty")
    if len(ids) > max_input_len:
        return FinishReason(
            "error", message=f"prompt of {len(ids)} tokens exceeds the limit of {max_input_len}"
        )
    if min(ids) < 0 or max(ids) >= vocab_size:
        return FinishReason("error", message=f"prompt token ids must be in [0, {vocab_size})")
    predicted = req.prediction_ids
    if predicted is not None and (
        not predicted or any(type(t) is not int or not 0 <= t < vocab_size for t in predicted)
    ):
        return FinishReason("error", message=f"prediction token ids must be in [0, {vocab_size})")
    params.verify()
    for name in INTEGER_FIELDS:
        value = getattr(params, name)
        if type(value) is not int and not (name == "logprobs" and value is None):
            return FinishReason("error", message=f"{name} must be an integer, got {value!r}")
    if params.max_new_tokens == 0 and params.logprob_start_len is None and not embedding:
        return FinishReason("length")  # nothing to compute (with prompt logprobs: prefill, no sampling)
    return None
