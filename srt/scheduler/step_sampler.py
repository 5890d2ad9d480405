"""Per-request fault isolation in the scheduler: one request whose handling raises finishes with `error`,
never the process.

What is isolated: sampling a batch (a bad seed, penalty token list or top-logprobs count makes the batch call
raise; the batch is then sampled row by row and only the rows that raise fail) and checking stop conditions.
What is not: `PROCESS_FATAL_ERRORS` and anything outside these guards (the forward pass, the KV pool's
invariants), which are the process's failures and still end it.

A failed request gets `FinishReason("error")` and one log line naming its rid; its holder frees its memory.
"""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING

import torch

from srt.io_struct import FinishReason
from srt.sampling.sampler import SampleOutput, Sampler
from srt.sampling.sampling_batch import SamplingBatch

if TYPE_CHECKING:
    from srt.constrained.bitmask import GrammarMask
    from srt.scheduler.schedule_batch import Req

logger = logging.getLogger(__name__)

# Failures of the process, not of one request: never isolated.
PROCESS_FATAL_ERRORS = (MemoryError, torch.cuda.OutOfMemoryError)
# Test hook, off unless set when the scheduler starts: a request whose rid contains this variable's value
# raises inside sampling at its TEST_FAULT_DECODE_STEP-th decode step.
TEST_FAULT_ENV = "SRT_TEST_FAULT_RID"
TEST_FAULT_DECODE_STEP = 3
# Token of a row whose sampling failed; its request is finished, so the value is never appended.
NO_TOKEN = -1


def fail_request(req: Req, doing: str, exc: Exception) -> None:
    """Finish one request with `error` because handling it raised: one error line, the traceback at debug."""
    logger.error("Request %s failed while %s: %s: %s", req.rid, doing, type(exc).__name__, exc)
    logger.debug("Traceback of request %s's failure", req.rid, exc_info=exc)
    req.finished_reason = FinishReason("error", message=f"failed while {doing}: {type(exc).__name__}: {exc}")


class IsolatingSampler:
    """The batch sampler with a row-by-row fallback. The vectorised batch call is the normal path; the
    fallback runs only after it raised, and gives the surviving rows exactly their batch tokens because the
    sampler raises for a request's parameters before it draws any random number.

    It also keeps the batch's `SamplingBatch` (the parameter tensors) and rebuilds it only when the requests
    differ from the previous call's (same objects in the same order: a steady decode batch), counting
    builds in `num_batch_builds`."""

    def __init__(self, sampler: Sampler, test_fault_rid: str | None = None):
        self.sampler = sampler
        self.test_fault_rid = test_fault_rid
        self.num_batch_builds = 0
        self._batch: SamplingBatch | None = None
        self._batch_reqs: list[Req] = []

    def sample(
        self, logits: torch.Tensor, reqs: list[Req], grammar_mask: GrammarMask | None = None
    ) -> SampleOutput:
        """Next tokens for `reqs`; a request whose row cannot be sampled is finished with `error` and gets
        `NO_TOKEN`."""
        try:
            return self._sample(logits, self._batch_for(reqs), grammar_mask)
        except PROCESS_FATAL_ERRORS:
            raise
        except Exception as e:
            logger.debug("Sampling a batch of %d failed (%r); sampling row by row", len(reqs), e)
        next_ids: list[int] = []
        token_logprobs: list[float] = []
        top_logprobs: list[list[tuple[int, float]]] = []
        for i, req in enumerate(reqs):
            try:
                one = self._sample(
                    logits[i : i + 1], self._build([req]), grammar_mask and grammar_mask.for_row(i)
                )
            except PROCESS_FATAL_ERRORS:
                raise
            except Exception as e:
                fail_request(req, "sampling", e)
                one = SampleOutput([NO_TOKEN], None, None)
            next_ids.append(one.next_token_ids[0])
            token_logprobs.append(one.token_logprobs[0] if one.token_logprobs else 0.0)
            top_logprobs.append(one.top_logprobs[0] if one.top_logprobs else [])
        return SampleOutput(next_ids, token_logprobs, top_logprobs)

    def release(self, req: Req) -> None:
        """The request left the running batch (finished, aborted or retracted)."""
        self.sampler.release(req)

    def _batch_for(self, reqs: list[Req]) -> SamplingBatch:
        cached = self._batch_reqs
        if self._batch is None or len(reqs) != len(cached) or any(map(operator.is_not, reqs, cached)):
            self._batch = None  # a build that raises leaves no stale batch behind
            self._batch = self._build(reqs)
            self._batch_reqs = list(reqs)
        return self._batch

    def _build(self, reqs: list[Req]) -> SamplingBatch:
        sampler = self.sampler
        self.num_batch_builds += 1
        return SamplingBatch.build(
            reqs, sampler.vocab_size, sampler.eos_token_ids, sampler.penalty_pool, sampler.device
        )

    def _sample(
        self, logits: torch.Tensor, batch: SamplingBatch, grammar_mask: GrammarMask | None
    ) -> SampleOutput:
        if self.test_fault_rid is not None:
            for req in batch.rows:
                if self.test_fault_rid in req.rid and len(req.output_ids) == TEST_FAULT_DECODE_STEP:
                    raise RuntimeError(f"injected test fault ({TEST_FAULT_ENV})")
        return self.sampler.sample(logits, batch, grammar_mask)


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
