"""Appending a step's sampled tokens to their requests and checking their stop conditions, with a check
that raises failing only its own request (`fault_isolation.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.scheduler.fault_isolation import PROCESS_FATAL_ERRORS, fail_request

if TYPE_CHECKING:
    from srt.sampling.sampler import SampleOutput
    from srt.scheduler.schedule_batch import Req


def append_tokens(
    out: SampleOutput, reqs: list[Req], step_ts: float, eos_token_ids: frozenset[int], context_len: int
) -> None:
    """Give each request its sampled token and check its stop conditions. One try covers the batch: when a
    request's check raises, that request finishes with `error` and the loop resumes after it."""
    start = 0
    while start < len(reqs):
        i = start
        try:
            for i in range(start, len(reqs)):
                req = reqs[i]
                if req.finished:  # its sampling failed
                    continue
                lp = (
                    out.token_logprobs[i]
                    if out.token_logprobs is not None and req.sampling_params.logprobs is not None
                    else None
                )
                top = out.top_logprobs[i] if lp is not None and out.top_logprobs is not None else None
                req.append_token(out.next_token_ids[i], step_ts, lp, top)
                req.check_finished(eos_token_ids, context_len)
            return
        except PROCESS_FATAL_ERRORS:
            raise
        except Exception as e:
            fail_request(reqs[i], "checking stop conditions", e)
            start = i + 1
