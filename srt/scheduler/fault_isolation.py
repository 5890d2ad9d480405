"""Per-request fault isolation in the scheduler: one request whose handling raises finishes with `error`,
never the process.

What is isolated: admitting a request, sampling a batch (a bad seed, penalty token list or top-logprobs count
makes the batch call raise; `step_sampler.py` then samples row by row and only the rows that raise fail), the
same for a speculative verify step's drafting requests (request by request over each one's rows), checking
stop conditions (`token_append.py`) and compiling a grammar. What is not: `PROCESS_FATAL_ERRORS` and
anything outside these guards (the forward pass, the KV pool's invariants), which are the process's failures
and still end it.

A failed request gets `FinishReason("error")` and one log line naming its rid; its holder frees its memory.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from srt.io_struct import FinishReason

if TYPE_CHECKING:
    from srt.scheduler.schedule_batch import Req

logger = logging.getLogger(__name__)

# Failures of the process, not of one request: never isolated.
PROCESS_FATAL_ERRORS = (MemoryError, torch.cuda.OutOfMemoryError)
# Test hook, off unless set when the scheduler starts: a request whose rid contains this variable's value
# raises inside sampling at the step that would choose its TEST_FAULT_DECODE_STEP-th output token (0-based:
# the decode step where it has that many, or the verify step whose run covers that position).
TEST_FAULT_ENV = "SRT_TEST_FAULT_RID"
TEST_FAULT_DECODE_STEP = 3
# Token of a row whose sampling failed; its request is finished, so the value is never appended.
NO_TOKEN = -1


def fail_request(req: Req, doing: str, exc: Exception) -> None:
    """Finish one request with `error` because handling it raised: one error line, the traceback at debug."""
    logger.error("Request %s failed while %s: %s: %s", req.rid, doing, type(exc).__name__, exc)
    logger.debug("Traceback of request %s's failure", req.rid, exc_info=exc)
    req.finished_reason = FinishReason("error", message=f"failed while {doing}: {type(exc).__name__}: {exc}")
