"""Which waiting requests a step prefills: the waiting queue in policy order, fitted into the step's token
and KV budgets by `PrefillAdder`, around a long prompt that is mid-chunk. Its own module because it is the
scheduler's one decision with rules of its own (budgets, chunking, fairness to a chunk); the scheduler
keeps the queues and applies the answer."""

from __future__ import annotations

from dataclasses import dataclass

from srt.scheduler.schedule_batch import Req
from srt.scheduler.schedule_policy import AddResult, PrefillAdder, order_waiting_queue
from srt.server_args import ServerArgs

# While others wait, a prompt mid-chunk keeps at least this share of the step's prefill tokens: the waiting
# prompts that go ahead of it share the rest. Its throughput then stays above this share of its throughput
# alone however many prompts queue (in practice far closer: a prompt goes ahead once, and a decode row costs
# one token), and it never falls to chunks where each step's fixed cost dominates.
LONG_PROMPT_MIN_SHARE = 0.5


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
    ):
        self.policy = args.schedule_policy
        self.max_prefill_tokens = args.max_prefill_tokens
        self.chunked_prefill_size = args.chunked_prefill_size
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.max_running_requests = max_running_requests
        self.lora = lora  # SchedulerLoRA or None: an admitted request's adapter must fit the step

    def admit(
        self,
        waiting: list[Req],
        running: list[Req],
        chunked_req: Req | None,
        new_token_ratio: float,
        token_budget: int | None = None,
        decode_tokens: int = 0,
    ) -> Admission:
        """Admit waiting work. `token_budget` caps this step's prefill tokens (the scheduler's time-bounded
        budget) on top of the chunk and prefill limits; `decode_tokens` KV slots are kept for the running
        batch's decode."""
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
            self._admit_ahead_of_chunk(adder, waiting, chunked_req)
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

    def _admit_ahead_of_chunk(self, adder: PrefillAdder, waiting: list[Req], chunked_req: Req) -> None:
        """A long prompt is mid-chunk and others wait: the waiting prompts that fit whole in the step's budget
        less the long prompt's floor (LONG_PROMPT_MIN_SHARE of it) go first, and the chunk takes the rest.

        The step's budget is what it would be for the long prompt alone (the scheduler gives a step that
        continues a long prompt the LONE_PREFILL_STEP_SECONDS budget of srt/scheduler/mixed_chunk.py, decode
        rows riding along), so a request arriving during a long prefill waits for at most one such step, and
        the step costs the same bounded time whoever shares it. The chunk is never sized from a second,
        smaller budget: the earlier rule bounded it like a mixed step, which at a long context is a few dozen
        tokens: a 6,300-token prompt crawled at 32-token steps (twice its time alone) and plain requests
        arriving meanwhile still waited 1.8-8.5 s. Without the rule, one long prompt (a request with 128 tools
        is 6,300 tokens) held every later request for its whole prefill: 36 s for a 4-token completion on a
        2-core CPU."""
        floor = max(1, int(min(adder.rem_chunk, adder.rem_input) * LONG_PROMPT_MIN_SHARE))
        for req in waiting:
            added = adder.add_one_req(req, keep=floor)
            if added not in (AddResult.CONTINUE, AddResult.SKIP):
                break
        adder.add_chunked_req(chunked_req, at_least=floor)
