"""Which waiting requests a step prefills: the waiting queue in policy order, fitted into the step's token
and KV budgets by `PrefillAdder`, around a long prompt that is mid-chunk. Its own module because it is the
scheduler's one decision with rules of its own (budgets, chunking, fairness to a chunk); the scheduler
keeps the queues and applies the answer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from srt.scheduler.mixed_chunk import MIN_MIXED_PREFILL_TOKENS, MixedChunkBudget
from srt.scheduler.schedule_batch import Req
from srt.scheduler.schedule_policy import AddResult, PrefillAdder, order_waiting_queue
from srt.server_args import ServerArgs


@dataclass
class Admission:
    """A step's prefill: what runs, what still waits, and the prompt left mid-chunk (if any)."""

    can_run: list[Req]
    waiting: list[Req]
    chunked_req: Req | None


class PrefillAdmission:
    """Built once by the scheduler with what does not change between steps."""

    def __init__(
        self,
        args: ServerArgs,
        tree_cache,
        allocator,
        req_to_token_pool,
        max_running_requests: int,
        lora,
        mixed_budget: MixedChunkBudget | None,
    ):
        self.policy = args.schedule_policy
        self.max_prefill_tokens = args.max_prefill_tokens
        self.chunked_prefill_size = args.chunked_prefill_size
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.max_running_requests = max_running_requests
        self.lora = lora  # SchedulerLoRA or None: an admitted request's adapter must fit the step
        self.mixed_budget = mixed_budget

    def admit(
        self,
        waiting: list[Req],
        running: list[Req],
        chunked_req: Req | None,
        new_token_ratio: float,
        token_budget: int | None = None,
        decode_tokens: int = 0,
    ) -> Admission:
        """Admit waiting work. `token_budget` caps this step's prefill tokens (a mixed step's budget) on top of
        the chunk and prefill limits; `decode_tokens` KV slots are kept for the running batch's decode."""
        if not waiting and chunked_req is None:
            return Admission([], waiting, chunked_req)
        slots = min(self.max_running_requests - len(running), self.req_to_token_pool.available_size())
        if slots <= 0 and chunked_req is None:
            return Admission([], waiting, chunked_req)
        order_waiting_queue(self.policy, waiting, self.tree_cache)
        max_prefill, chunk = self.max_prefill_tokens, self.chunked_prefill_size
        if token_budget is not None:
            max_prefill = min(max_prefill, token_budget)
            chunk = min(chunk, token_budget) if chunk > 0 else chunk
        adder = PrefillAdder(
            self.tree_cache,
            self.allocator,
            running,
            new_token_ratio,
            max_prefill,
            chunk,
            max_new_reqs=max(slots, 0),
            reserved_tokens=decode_tokens,
            lora_fits=self.lora.fits if self.lora is not None else None,
            chunked=chunked_req,
        )
        if chunked_req is not None and waiting:
            self._admit_ahead_of_chunk(adder, waiting, running, chunked_req)
        else:
            result = AddResult.CONTINUE
            if chunked_req is not None:
                result = adder.add_chunked_req(chunked_req)
            if result == AddResult.CONTINUE:
                for req in waiting:
                    added = adder.add_one_req(req)
                    if added not in (AddResult.CONTINUE, AddResult.SKIP):
                        break
        admitted = set(map(id, adder.can_run))
        still_waiting = [r for r in waiting if id(r) not in admitted]
        return Admission(adder.can_run, still_waiting, adder.new_chunked_req)

    def _admit_ahead_of_chunk(
        self, adder: PrefillAdder, waiting: list[Req], running: list[Req], chunked_req: Req
    ) -> None:
        """A long prompt is mid-chunk and others wait: the waiting prompts that fit whole go first, and the
        chunk shares the step with them, bounded like a mixed step (where the cost model runs) but never
        below MIN_MIXED_PREFILL_TOKENS. Otherwise one long prompt (a request with 128 tools is 6,000
        tokens) holds every later request until its whole prefill is done: 36 s for a 4-token completion
        on a 2-core CPU."""
        for req in waiting:
            added = adder.add_one_req(req, whole_only=True)
            if added not in (AddResult.CONTINUE, AddResult.SKIP):
                break
        at_most = math.inf
        if self.mixed_budget is not None and adder.can_run:
            at_most = self.mixed_budget.prefill_tokens(len(running) + len(adder.can_run))
        adder.add_chunked_req(chunked_req, at_most=at_most, at_least=MIN_MIXED_PREFILL_TOKENS)
