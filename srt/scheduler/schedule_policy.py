"""Which waiting requests join the next prefill batch: queue order (`fcfs`, `lpm`) and admission within the
token budgets and the KV memory that running requests still need (`PrefillAdder`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum, auto

from srt.scheduler.schedule_batch import Req

# Future decode tokens of one request counted against free KV are capped: max_tokens is an upper bound that
# most requests never reach, and reserving it in full would starve admission.
CLIP_MAX_NEW_TOKENS = 4096
# Queues longer than this fall back from lpm to fcfs: matching every waiting prompt each step costs more
# than the better order gains.
LPM_MAX_QUEUE = 128
# Decode-memory reservation ratio (SGLang's new_token_ratio): the share of each running request's remaining
# max_new_tokens that admission keeps free. It starts cautious, decays while decoding goes well and is raised
# again after a retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# After a retraction, assume each remaining request decodes at least this many more tokens.
RETRACT_DECODE_STEPS = 20


def decayed_new_token_ratio(ratio: float) -> float:
    """The ratio after one decode step that needed no retraction."""
    return max(ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)


def new_token_ratio_after_retraction(running: list[Req]) -> float:
    """The ratio once a retraction has left `running`: what they decoded so far plus
    `RETRACT_DECODE_STEPS` each, over what they may decode in all, never below the initial caution."""
    decoded = sum(len(r.output_ids) for r in running)
    budget = sum(r.sampling_params.max_new_tokens for r in running) or 1
    return max(min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / budget), INIT_NEW_TOKEN_RATIO)


def retract_until_decode_fits(
    running: list[Req], room: Callable[[], int], release: Callable[[Req], None]
) -> tuple[list[Req], Req | None]:
    """Take requests out of `running` (releasing each) until `room()` KV slots cover one decode token apiece.

    The retracted are those with the least output (least work lost), longest prompt first among equals.
    Returns them in the order they were taken, and the last request left if even it alone does not fit (a
    request larger than the whole pool), which is then out of `running` too."""
    if room() >= len(running):
        return [], None
    running.sort(key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
    retracted: list[Req] = []
    while len(running) > 1 and room() < len(running):
        retracted.append(running.pop())
        release(retracted[-1])
    too_large = None
    if room() < len(running):
        too_large = running.pop()
        release(too_large)
    return retracted, too_large


def order_waiting_queue(policy: str, waiting: list[Req], tree_cache) -> None:
    """Sort `waiting` in place. fcfs keeps arrival order; lpm puts the longest cached prefix first."""
    if policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE:
        lens = {
            id(r): len(tree_cache.match_prefix(r.seq_ids[:-1], r.lora_name).device_indices) for r in waiting
        }
        waiting.sort(key=lambda r: -lens[id(r)])


class AddResult(Enum):
    CONTINUE = auto()
    NO_TOKEN = auto()  # out of KV memory: stop admitting
    OTHER = auto()  # out of a token budget or request slots: stop admitting
    SKIP = auto()  # its LoRA adapter does not fit next to the step's others: try the next request


class PrefillAdder:
    """Admits requests while the prefill token budget, the chunk size and the KV memory allow.

    Memory left for new work = free slots + evictable cache slots − what running requests are expected to
    still decode (`remaining_new_tokens × new_token_ratio`). A request is admitted if its new prompt tokens
    plus its own expected decode fit; a prompt longer than the chunk budget is admitted as a first chunk and
    closes the batch. Admitted requests lock their matched prefix so eviction cannot take it.
    `reserved_tokens`: KV slots the same step takes for other work (a mixed step's decode tokens).
    `lora_fits` (multi-LoRA on): whether a set of adapters can share one step; a request whose adapter would
    not fit next to the running ones and those admitted so far is skipped (SKIP), not the end of admission."""

    def __init__(
        self,
        tree_cache,
        allocator,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        max_new_reqs: int,
        reserved_tokens: int = 0,
        lora_fits: Callable[[list[str | None]], bool] | None = None,
        chunked: Req | None = None,
    ):
        self.tree_cache = tree_cache
        self.lora_fits = lora_fits
        # the adapters the step already serves: the running batch's and a prompt mid-chunk's
        self.lora_names = {r.lora_name for r in [*running, *([chunked] if chunked else [])]}
        self.new_token_ratio = new_token_ratio
        reserved = sum(min(r.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) for r in running) * new_token_ratio
        free = allocator.available_size() + tree_cache.evictable_size()
        self.rem_total = free - reserved - reserved_tokens
        # KV slots this step can really take (no future decode counted): the hard limit of a continued chunk
        self.rem_now = free - reserved_tokens
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunked_prefill_size if chunked_prefill_size > 0 else math.inf
        self.max_new_reqs = max_new_reqs
        self.nothing_running = not running
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    def _lock(self, req: Req) -> int:
        """Lock the request's matched prefix; returns how many slots stopped being evictable."""
        before = self.tree_cache.evictable_size()
        self.tree_cache.inc_lock_ref(req.last_node)
        # Locked prefix slots are no longer evictable, so they no longer count as room for new work.
        locked = before - self.tree_cache.evictable_size()
        self.rem_total -= locked
        self.rem_now -= locked
        return locked

    def add_chunked_req(self, req: Req, at_least: int = 0, at_most: int | None = None) -> AddResult:
        """Continue a prompt already being prefilled in chunks (its prefix is its own, already locked):
        within the step's budget, but at least `at_least` tokens if KV room allows (so requests admitted
        ahead of it cannot starve it), and at most `at_most` (so the step they joined stays short)."""
        rest = len(req.fill_ids) - req.kv_len
        budget = max(min(self.rem_chunk, self.rem_input), at_least)
        if at_most is not None:
            budget = min(budget, max(at_most, at_least))
        req.extend_len = int(min(rest, budget, max(self.rem_now, 0)))
        if req.extend_len == 0:  # no KV slot free now: the chunk waits for running requests to free some
            self.new_chunked_req = req
            return AddResult.NO_TOKEN
        self.can_run.append(req)
        self._take(req.extend_len)
        if req.is_chunked:
            self.new_chunked_req = req
            return AddResult.OTHER
        self.rem_total -= min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
        return AddResult.CONTINUE

    def add_one_req(self, req: Req, keep: int | None = None) -> AddResult:
        """Admit a waiting request: its whole prompt, or a first chunk of it that closes the batch. With
        `keep` (while another prompt is mid-chunk: one chunked request at a time), only a whole prompt that
        leaves `keep` tokens of the budget to the prompt mid-chunk."""
        if len(self.can_run) >= self.max_new_reqs:
            return AddResult.OTHER
        if (
            self.lora_fits is not None
            and req.lora_name not in self.lora_names
            and not self.lora_fits([*self.lora_names, req.lora_name])
        ):
            return AddResult.SKIP
        req.prepare_fill()
        match = self.tree_cache.match_prefix(req.fill_ids[: req.prefix_match_len], req.lora_name)
        req.prefix_indices, req.last_node = match.device_indices, match.last_node
        req.kv_len = len(req.prefix_indices)
        extend = len(req.fill_ids) - req.kv_len
        future = min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
        first_alone = self.nothing_running and not self.can_run
        if extend + future > self.rem_total and not (first_alone and extend + 1 <= self.rem_total):
            req.reset_prefix()
            return AddResult.NO_TOKEN
        if self.rem_input <= 0 or self.rem_chunk <= 0:
            req.reset_prefix()
            return AddResult.OTHER
        budget = min(self.rem_chunk, self.rem_input)
        if keep is not None and extend > budget - keep:
            req.reset_prefix()
            return AddResult.OTHER
        if extend > budget and math.isinf(self.rem_chunk) and self.can_run:
            # Chunking is off: a prompt over the remaining budget waits for a batch of its own.
            req.reset_prefix()
            return AddResult.OTHER
        locked = self._lock(req)
        req.extend_len = int(extend if math.isinf(self.rem_chunk) else min(extend, budget))
        if req.extend_len > self.rem_now:
            # Its own cached prefix counted as evictable room until locked: the slots are not there now.
            self.tree_cache.dec_lock_ref(req.last_node)
            self.rem_total += locked
            self.rem_now += locked
            req.reset_prefix()
            return AddResult.NO_TOKEN
        self.can_run.append(req)
        self.lora_names.add(req.lora_name)
        self._take(req.extend_len)
        if req.is_chunked:
            self.new_chunked_req = req
            return AddResult.OTHER
        self.rem_total -= future
        return AddResult.CONTINUE

    def _take(self, n: int) -> None:
        self.rem_total -= n
        self.rem_now -= n
        self.rem_input -= n
        self.rem_chunk -= n
