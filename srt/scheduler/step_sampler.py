"""The scheduler's sampler for a step's rows: the vectorised batch call, with a row-by-row fallback that
isolates a request whose parameters make sampling raise (`fault_isolation.py`), and the step's
`SamplingBatch` kept while the batch's requests stay the same. A speculative verify step's drafting requests
are sampled here too (`verify`, `run_logprobs`: srt/sampling/verify_rows.py), their fallback request by
request over each request's own rows."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from srt.sampling.sampler import SampleOutput, Sampler
from srt.sampling.sampling_batch import SamplingBatch
from srt.sampling.verify_rows import RunLogprobs, record_run_penalties, run_logprobs, verify_targets
from srt.scheduler.fault_isolation import (
    NO_TOKEN,
    PROCESS_FATAL_ERRORS,
    TEST_FAULT_DECODE_STEP,
    TEST_FAULT_ENV,
    fail_request,
)
from srt.speculative.verify import DraftBatch, VerifyResult, verify

if TYPE_CHECKING:
    from srt.constrained.bitmask import GrammarMask
    from srt.scheduler.schedule_batch import Req

logger = logging.getLogger(__name__)

T = TypeVar("T")


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

    def verify(
        self, logits: torch.Tensor, reqs: Sequence[Req], drafts: Sequence[list[int]]
    ) -> tuple[list[list[int]], list[int]]:
        """Judge each request's drafts (every one non-empty) against its k + 1 rows of `logits`, packed request
        after request. Returns, per request, the tokens to append (its accepted drafts, then the bonus or
        recovered token) and how many drafts were accepted; a request whose rows cannot be sampled is finished
        with `error` and gets no token."""
        try:
            result = self._verify(logits, reqs, drafts)
            return result.token_ids(), result.accepted
        except PROCESS_FATAL_ERRORS:
            raise
        except Exception as e:
            logger.debug("Verifying a batch of %d failed (%r); verifying request by request", len(reqs), e)
        results = self._by_request(
            logits, reqs, drafts, lambda rows, i: self._verify(rows, reqs[i : i + 1], drafts[i : i + 1]), None
        )
        runs = [r.token_ids()[0] if r is not None else [] for r in results]
        return runs, [r.accepted[0] if r is not None else 0 for r in results]

    def run_logprobs(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        drafts: Sequence[list[int]],
        tokens: Sequence[list[int]],
    ) -> list[RunLogprobs | None] | None:
        """The logprobs of each verified run's tokens (`verify_rows.run_logprobs`); a request whose logprobs
        cannot be read is finished with `error` (its tokens are chosen already: the others' stay theirs)."""
        vocab_size = self.sampler.vocab_size
        try:
            return run_logprobs(logits, reqs, drafts, tokens, vocab_size)
        except PROCESS_FATAL_ERRORS:
            raise
        except Exception as e:
            logger.debug("Logprobs of a batch of %d failed (%r); request by request", len(reqs), e)

        def one(rows: torch.Tensor, i: int) -> RunLogprobs | None:
            out = run_logprobs(rows, reqs[i : i + 1], drafts[i : i + 1], tokens[i : i + 1], vocab_size)
            return out[0] if out is not None else None

        return self._by_request(logits, reqs, drafts, one, None)

    def record_runs(self, reqs: Sequence[Req], tokens: Sequence[list[int]], taken: Sequence[int]) -> None:
        """The penalty pool counts the tokens a verify step appended (`taken` of each run)."""
        record_run_penalties(self.sampler.penalty_pool, reqs, tokens, taken)

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
            self._raise_test_fault(batch.rows, [[]] * len(batch.rows))
        return self.sampler.sample(logits, batch, grammar_mask)

    def _verify(self, logits: torch.Tensor, reqs: Sequence[Req], drafts: Sequence[list[int]]) -> VerifyResult:
        """Every parameter-dependent step (`verify_targets`) before verification's random draws."""
        if self.test_fault_rid is not None:
            self._raise_test_fault(reqs, drafts)
        targets = verify_targets(logits, reqs, drafts, self.sampler)
        batch = DraftBatch.build(drafts, logits.device)
        return verify(batch, targets.logits, targets.probs, targets.greedy, targets.generators)

    def _by_request(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        drafts: Sequence[list[int]],
        call: Callable[[torch.Tensor, int], T],
        failed: T,
    ) -> list[T]:
        """`call(rows, i)` for each request i over its own k_i + 1 rows, after the batch call raised: a
        request whose call raises is finished with `error` and gets `failed`."""
        out: list[T] = []
        start = 0
        for i, (req, ids) in enumerate(zip(reqs, drafts, strict=True)):
            end = start + len(ids) + 1
            try:
                out.append(call(logits[start:end], i))
            except PROCESS_FATAL_ERRORS:
                raise
            except Exception as e:
                fail_request(req, "sampling", e)
                out.append(failed)
            start = end
        return out

    def _raise_test_fault(self, reqs: Sequence[Req], drafts: Sequence[list[int]]) -> None:
        """The test hook: raise when a request named by it is about to choose its TEST_FAULT_DECODE_STEP-th
        output token (0-based), in a plain step (one row) or a verify step (its drafts' rows and one more)."""
        for req, ids in zip(reqs, drafts, strict=True):
            first = len(req.output_ids)
            if self.test_fault_rid in req.rid and first <= TEST_FAULT_DECODE_STEP <= first + len(ids):
                raise RuntimeError(f"injected test fault ({TEST_FAULT_ENV})")
