"""The scheduler's sampler for a step's rows: the vectorised batch call, with a row-by-row fallback that
isolates a request whose parameters make sampling raise (`fault_isolation.py`), and the step's
`SamplingBatch` kept while the batch's requests stay the same."""

from __future__ import annotations

import logging
import operator
from typing import TYPE_CHECKING

import torch

from srt.sampling.sampler import SampleOutput, Sampler
from srt.sampling.sampling_batch import SamplingBatch
from srt.scheduler.fault_isolation import (
    NO_TOKEN,
    PROCESS_FATAL_ERRORS,
    TEST_FAULT_DECODE_STEP,
    TEST_FAULT_ENV,
    fail_request,
)

if TYPE_CHECKING:
    from srt.constrained.bitmask import GrammarMask
    from srt.scheduler.schedule_batch import Req

logger = logging.getLogger(__name__)


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
