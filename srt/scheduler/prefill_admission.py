"""Which waiting requests a step prefills: the waiting queue in policy order, fitted into the step's token
and KV budgets by `PrefillAdder`, around a long prompt that is mid-chunk. Its own module because it is the
scheduler's one decision with rules of its own (budgets, chunking, fairness to a chunk); the scheduler
keeps the queues and applies the answer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from srt.scheduler.mixed_chunk import MIN_MIXED_PREFILL_TOKENS
from srt.scheduler.schedule_batch import Req
from srt.scheduler.schedule_policy import AddResult, PrefillAdder, order_waiting_queue
from srt.server_args import ServerArgs

# A prompt mid-chunk keeps at least this share of the prefill tokens offered to it over all its steps so far
# (its ledger, below), however many prompts queue: its throughput stays above this share of its throughput
# alone. Within that share the prompts waiting go first and the chunk falls to MIN_MIXED_PREFILL_TOKENS (it
# always progresses), so the step an arrival joins is its own prefill plus a small chunk, not a full step (a
# fixed half of every step made an arrival wait the step in flight plus a second whole one: 2.1 s beyond its
# time alone on a 2-core CPU).
LONG_PROMPT_MIN_SHARE = 0.5


@dataclass
class ChunkLedger:
    """The prompt mid-chunk's account: the prefill tokens its steps offered it (what it could have taken
    alone) and the tokens it took. The waiting prompts that go ahead of it spend its surplus."""

    req: Req
    offered: int = 0
    taken: int = 0
    long: bool = False  # a continued step found it needing more than the whole step

    def floor(self, offer: int) -> int:
        """The fewest tokens it takes this step so that `taken` stays ≥ LONG_PROMPT_MIN_SHARE × `offered`."""
        owed = math.ceil(LONG_PROMPT_MIN_SHARE * (self.offered + offer)) - self.taken
        return min(offer, max(MIN_MIXED_PREFILL_TOKENS, owed))

    def record(self, offer: int, took: int) -> None:
        self.offered += offer
        self.taken += took


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
        self.ledger: ChunkLedger | None = None  # the prompt mid-chunk's, from its first continued chunk

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
        if chunked_req is not None:
            self._continue_chunk(adder, waiting, chunked_req, short_steps=token_budget is not None)
        else:
            for req in waiting:
                added = adder.add_one_req(req)
                if added not in (AddResult.CONTINUE, AddResult.SKIP):
                    break
            first = adder.new_chunked_req
            if first is not None:  # a first chunk: taken whole, as offered
                self.ledger = ChunkLedger(first, first.extend_len, first.extend_len)
        admitted = set(map(id, adder.can_run))
        still_waiting = [r for r in waiting if id(r) not in admitted]
        return Admission(adder.can_run, still_waiting, adder.new_chunked_req)

    def _continue_chunk(
        self, adder: PrefillAdder, waiting: list[Req], chunked_req: Req, short_steps: bool
    ) -> None:
        """A long prompt is mid-chunk: the waiting prompts that fit whole in the step's budget less the long
        prompt's floor (its ledger's: see LONG_PROMPT_MIN_SHARE) go first, and the chunk takes the rest or,
        where steps are bounded in time (`short_steps`: the cost model's budget) and the prompt needs more
        than this step anyway, only its floor beside them: the step they joined then costs their prefill
        and a small chunk, not a full step.

        The step's budget is what it would be for the long prompt alone (the scheduler gives a step that
        continues a long prompt the LONE_PREFILL_STEP_SECONDS budget of srt/scheduler/mixed_chunk.py, decode
        rows riding along), so a request arriving during a long prefill waits for the step in flight, then
        for its own prefill beside a small chunk (larger only once arrivals have spent the long prompt's
        surplus). The chunk is never sized from a second, smaller budget: the earlier
        rule bounded it like a mixed step, which at a long context is a few dozen tokens: a 6,300-token
        prompt crawled at 32-token steps (twice its time alone). Without the rule, one long prompt (a request
        with 128 tools is 6,300 tokens) held every later request for its whole prefill: 36 s for a 4-token
        completion on a 2-core CPU."""
        if self.ledger is None or self.ledger.req is not chunked_req:
            self.ledger = ChunkLedger(chunked_req)
        budget = int(min(adder.rem_chunk, adder.rem_input))
        rest = len(chunked_req.fill_ids) - chunked_req.kv_len
        offer = min(budget, rest)
        # A prompt that needs more than this whole step is long: the arrivals spend its surplus (its ledger's
        # floor) and, where steps are bounded in time, the chunk beside them is that floor. It stays long to
        # its last chunk, which is deep into its context (88 tokens after 2,900 took 0.34 s on a 2-core CPU,
        # and an arrival beside it waited for them). One that would finish in this step and never needed
        # more keeps half of it and takes the rest: going ahead of it only reorders equal work and adds a
        # step (at 16 concurrent 256-token prompts, TTFT p50 +25 %).
        long = self.ledger.long = self.ledger.long or rest > budget
        floor = max(1, self.ledger.floor(offer) if long else int(budget * LONG_PROMPT_MIN_SHARE))
        for req in waiting:
            added = adder.add_one_req(req, keep=floor)
            if added not in (AddResult.CONTINUE, AddResult.SKIP):
                break
        at_most = floor if short_steps and long and adder.can_run else None
        ran = adder.add_chunked_req(chunked_req, at_least=floor, at_most=at_most)
        ran = ran != AddResult.NO_TOKEN
        self.ledger.record(offer, chunked_req.extend_len if ran else 0)
