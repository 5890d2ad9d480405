"""Appending a step's sampled tokens to their requests and checking their stop conditions, with a check
that raises failing only its own request (`fault_isolation.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from srt.scheduler.fault_isolation import PROCESS_FATAL_ERRORS, fail_request

if TYPE_CHECKING:
    from srt.sampling.sampler import SampleOutput
    from srt.sampling.verify_rows import RunLogprobs
    from srt.scheduler.schedule_batch import Req


def _each_isolated(reqs: list[Req], append: Callable[[int, Req], None]) -> None:
    """`append(i, req)` for each unfinished request. One try covers the batch: when a request's call raises,
    that request finishes with `error` and the loop resumes after it."""
    start = 0
    while start < len(reqs):
        i = start
        try:
            for i in range(start, len(reqs)):
                if not reqs[i].finished:  # its sampling failed
                    append(i, reqs[i])
            return
        except PROCESS_FATAL_ERRORS:
            raise
        except Exception as e:
            fail_request(reqs[i], "checking stop conditions", e)
            start = i + 1


def append_tokens(
    out: SampleOutput, reqs: list[Req], step_ts: float, eos_token_ids: frozenset[int], context_len: int
) -> None:
    """Give each request its sampled token and check its stop conditions."""

    def append(i: int, req: Req) -> None:
        lp = (
            out.token_logprobs[i]
            if out.token_logprobs is not None and req.sampling_params.logprobs is not None
            else None
        )
        top = out.top_logprobs[i] if lp is not None and out.top_logprobs is not None else None
        req.append_token(out.next_token_ids[i], step_ts, lp, top)
        req.check_finished(eos_token_ids, context_len)

    _each_isolated(reqs, append)


def append_token_runs(
    runs: list[list[int]],
    reqs: list[Req],
    step_ts: float,
    eos_token_ids: frozenset[int],
    context_len: int,
    logprobs: list[RunLogprobs | None] | None = None,
) -> list[int]:
    """Give each request its run of tokens (a verify step's accepted drafts and the token after) one at a
    time, checking the stop conditions after each: a stop token, EOS or max_tokens inside the run ends the
    request there and the rest of the run is dropped. `logprobs[i]`: request i's logprob and top
    alternatives of each token of its run, when it asks for them. Returns how many tokens each request took."""
    taken = [0] * len(reqs)

    def append(i: int, req: Req) -> None:
        lps = logprobs[i] if logprobs is not None else None
        for j, token in enumerate(runs[i]):
            req.append_token(token, step_ts, *((lps[0][j], lps[1][j]) if lps is not None else (None, None)))
            taken[i] += 1
            req.check_finished(eos_token_ids, context_len)
            if req.finished:
                return

    _each_isolated(reqs, append)
    return taken
