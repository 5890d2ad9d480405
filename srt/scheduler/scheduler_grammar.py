"""The scheduler's structured-output steps, around `srt/constrained/grammar_manager.py`.

- Admission: a constrained request goes to the grammar queue instead of the waiting queue; at the start of
  each step those whose grammar is compiled join the waiting queue (each with its own matcher) and those
  whose grammar failed finish with `error`. Nothing else waits for a compilation.
- Sampling: `mask(reqs)` is the step's bitmask over the constrained rows (None, at no cost, when there are
  none); after sampling, `advance` feeds each constrained request its token: a rejected token or a raising
  matcher finishes that request alone with `error`, as does a mask the library flagged (it cannot be
  trusted); a grammar that has ended without an error finishes it with `stop`, so `stop` on a constrained
  request always means a complete match.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from srt.constrained import NO_GRAMMAR_BACKEND, constraint_key
from srt.constrained.bitmask import GrammarMask
from srt.constrained.grammar_manager import GrammarManager, GrammarMismatch
from srt.constrained.judge import short
from srt.io_struct import FinishReason
from srt.scheduler.fault_isolation import PROCESS_FATAL_ERRORS, fail_request
from srt.tokenizer_loading import load_tokenizer

if TYPE_CHECKING:
    from srt.model_executor.model_runner import ModelRunner
    from srt.scheduler.schedule_batch import Req
    from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class SchedulerGrammar:
    def __init__(self, args: ServerArgs, runner: ModelRunner, metrics: Any = None):
        self.manager: GrammarManager | None = None
        if args.grammar_backend != NO_GRAMMAR_BACKEND:
            tokenizer_path = args.tokenizer_path or runner.model_dir

            self.manager = GrammarManager(
                args.grammar_backend,
                functools.partial(
                    load_tokenizer, tokenizer_path
                ),  # a directory's, or built from a GGUF's metadata
                runner.vocab_size,
                runner.eos_token_ids,
                metrics=metrics,
                synchronous=args.tp_size > 1,  # every TP rank must admit a request in the same step
            )

    @property
    def num_queued(self) -> int:
        return len(self.manager.queue) if self.manager is not None else 0

    def submit(self, req: Req) -> bool:
        """Take `req` into the grammar queue if it is constrained (True); a constrained request on a server
        without a grammar backend finishes with `error`, also True."""
        key = constraint_key(req.sampling_params)
        if key is None:
            return False
        if self.manager is None:
            req.finished_reason = FinishReason(
                "error", message="structured output is disabled on this server"
            )
            return True
        self.manager.submit(req, key)
        return True

    def pop_ready(self) -> tuple[list[Req], list[Req]]:
        """(requests ready to be scheduled, requests finished because their grammar failed)."""
        if not self.num_queued:
            return [], []
        ready, failed = self.manager.pop_ready()
        for req, exc in failed:
            fail_request(req, "compiling its grammar", exc)
        return ready, [req for req, _ in failed]

    def remove(self, pred) -> list[Req]:
        return self.manager.remove(pred) if self.num_queued else []

    def mask(self, reqs: list[Req]) -> GrammarMask | None:
        if self.manager is None:
            return None
        return self.manager.fill_mask(reqs)

    def advance(self, reqs: list[Req], next_ids: list[int], mask: GrammarMask) -> None:
        for i in mask.rows:
            req = reqs[i]
            if req.finished and req.finished_reason.type == "error":  # its sampling failed: no token
                continue
            try:
                state = self.manager.advance(req, next_ids[i])
            except GrammarMismatch as e:
                kind = req.grammar.key.kind if req.grammar.key is not None else None
                req.finished_reason = FinishReason(
                    "error",
                    message=f"the {kind or 'constraint'} could not be enforced past token "
                    f"{len(req.output_ids)}: {short(str(e))}",
                    param=kind,
                )
                logger.error("Request %s: grammar failure at token %d: %s", req.rid, next_ids[i], e)
                continue
            except PROCESS_FATAL_ERRORS:
                raise
            except Exception as e:
                fail_request(req, "advancing its grammar", e)
                continue
            if state is True and not req.finished:
                req.finished_reason = FinishReason("stop")  # the grammar is complete

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()
