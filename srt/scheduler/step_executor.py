"""Running the forward step the scheduler chose, and taking its tokens: a prefill or mixed step, a decode
step, or, when some running request drafts, a verify step.

The scheduler decides *which* requests run (admission, chunking, retraction) and owns the queues; this
module owns *how* they run: it builds the step's batch, calls the model, samples or verifies, appends the
tokens, frees the KV of rejected drafts, and hands every request that finished to the scheduler's `finish`
callback the moment it finishes. It returns what happened (`StepOutcome`); the scheduler then updates its
running batch and reports the step with its own load snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from srt.io_struct import FinishReason
from srt.mem_cache.base_prefix_cache import BasePrefixCache
from srt.model_executor.model_runner import ModelRunner
from srt.scheduler.mixed_chunk import MixedChunkBudget, attention_keys
from srt.scheduler.pooling import add_chunk, finish_embedding, pool_rows
from srt.scheduler.prompt_logprobs import plan_prompt_logprobs
from srt.scheduler.schedule_batch import Req
from srt.scheduler.scheduler_grammar import SchedulerGrammar
from srt.scheduler.scheduler_tracing import SchedulerTracing
from srt.scheduler.spec_step import SpecDecoder
from srt.scheduler.step_builder import StepBuilder
from srt.scheduler.step_hooks import StepReporter
from srt.scheduler.step_sampler import IsolatingSampler
from srt.scheduler.token_append import append_tokens

logger = logging.getLogger(__name__)
# `--log-level debug`: every forward step's shape and time, for reading a workload step by step
STEP_DEBUG_LINE = "step: %d prefill tokens, %d decode rows, forward %.1f ms"


@dataclass
class StepOutcome:
    stepped: list[Req]  # every request the step ran, for the step's output
    # tokens appended to running requests (a decode row's one, a verify run's accepted drafts + 1)
    decode_tokens: int
    forward_seconds: float
    decoded: bool = True  # the step advanced the running batch (the scheduler then drops its finished)
    # a prefill or mixed step: the requests whose whole prompt is now in the KV (they join the running batch
    # unless already finished), and the prefill's figures for the reporter
    prefilled: list[Req] = field(default_factory=list)
    prefill_report: dict = field(default_factory=dict)


class StepExecutor:
    def __init__(
        self,
        runner: ModelRunner,
        builder: StepBuilder,
        tree_cache: BasePrefixCache,
        sampler: IsolatingSampler,
        grammar: SchedulerGrammar,
        spec: SpecDecoder,
        reporter: StepReporter,
        tracing: SchedulerTracing,
        mixed_budget: MixedChunkBudget | None,
        finish: Callable[[Req], None],
    ):
        """`finish(req)`: a request that finished during a step (its KV released and its end reported)."""
        self.runner, self.builder, self.tree_cache = runner, builder, tree_cache
        self.allocator = runner.token_to_kv_pool_allocator
        self.sampler, self.grammar, self.spec = sampler, grammar, spec
        self.reporter, self.tracing, self.mixed_budget = reporter, tracing, mixed_budget
        self.finish = finish
        self.eos_token_ids = frozenset(runner.eos_token_ids)
        self.context_len = runner.context_len

    def extend(self, reqs: list[Req], decode: list[Req]) -> StepOutcome:
        """A prefill step of `reqs`, or, with `decode` (the running batch), a mixed step that also decodes
        one token for each running request (or verifies their drafts)."""
        now = time.monotonic()
        prefill_report = self._first_scheduled(reqs, now)
        total = prefill_report["new_tokens"]
        plan = plan_prompt_logprobs(reqs)
        drafts = None
        if decode and plan is None:  # the running requests may draft in a mixed step too
            drafts = self._propose(decode, total + len(decode), prefill_tokens=total)
        if drafts is not None:
            verifying = [r for r, d in zip(decode, drafts, strict=True) if d]
            runs = [d for d in drafts if d]
            plain = [r for r, d in zip(decode, drafts, strict=True) if not d]
            batch = self.builder.verify(verifying, runs, plain, prefill=reqs)
        else:
            batch = self.builder.extend(reqs, decode, **(plan.batch_fields() if plan else {}))
        t0 = time.perf_counter()
        if plan is None:
            logits = self.runner.forward(batch)
        else:
            logits, scores = self.runner.forward_with_prompt_logprobs(batch)
            plan.deliver(scores)
        forward_seconds = time.perf_counter() - t0
        self.tracing.on_prefill_step(reqs, now, time.monotonic())
        self._observe(total, batch.num_tokens - total, forward_seconds, reqs, decode, drafts)
        for req in reqs:
            req.kv_len += req.extend_len
            req.extend_len = 0
        decode_tokens = len(decode)
        if drafts is not None:  # rows: each prefill's last, the verify runs, the plain decodes
            verify_rows = sum(len(r) + 1 for r in runs)
            rows = slice(len(reqs), len(reqs) + verify_rows)
            slots = batch.out_cache_loc[total : total + verify_rows]
            taken = self._accept_drafts(logits[rows], verifying, runs, slots)
            decode_tokens = sum(taken) + len(plain)
            first_plain = len(reqs) + verify_rows
            decode = plain
        else:
            first_plain = len(reqs)
        for req in decode:
            req.kv_len += 1
        done = [i for i, r in enumerate(reqs) if not r.is_chunked and r.sampling_params.max_new_tokens > 0]
        for req in reqs:
            if req.is_chunked:
                self.tree_cache.cache_unfinished_req(req)
            elif req.sampling_params.max_new_tokens == 0:  # prompt logprobs only: nothing to sample
                req.finished_reason = FinishReason("length")
                self.finish(req)
        # decoding requests first: a steady running batch keeps its order, and its sampling batch
        rows = [first_plain + i for i in range(len(decode))] + done
        sampled = decode + [reqs[i] for i in done]
        if sampled:
            in_order = rows == list(range(logits.shape[0]))
            self._sample_and_append(logits if in_order else logits[rows], sampled)
        return StepOutcome(
            stepped=reqs + (verifying + plain if drafts is not None else decode),
            decode_tokens=decode_tokens,
            forward_seconds=forward_seconds,
            decoded=bool(decode) or drafts is not None,
            prefilled=[reqs[i] for i in done],
            prefill_report=prefill_report,
        )

    def embed(self, reqs: list[Req], pooling: str) -> StepOutcome:
        """An embedding server's prefill step (--is-embedding): the prompts' final hidden states are pooled
        (srt/scheduler/pooling.py) instead of a token sampled, and a request whose whole prompt has run finishes
        with its vector. Nothing decodes, so the decode path never sees an embedding."""
        now = time.monotonic()
        prefill_report = self._first_scheduled(reqs, now)
        counts = [r.extend_len for r in reqs]
        batch = self.builder.extend(reqs, [])
        t0 = time.perf_counter()
        hidden = self.runner.forward_hidden(batch)
        forward_seconds = time.perf_counter() - t0
        self.tracing.on_prefill_step(reqs, now, time.monotonic())
        self._observe(prefill_report["new_tokens"], 0, forward_seconds, reqs)
        pooled = pool_rows(hidden, counts, pooling)
        for req, rows in zip(reqs, pooled, strict=True):
            req.kv_len += req.extend_len
            req.extend_len = 0
            req.pooled = add_chunk(req.pooled, rows, pooling)
            if req.is_chunked:
                self.tree_cache.cache_unfinished_req(req)
                continue
            req.embedding = finish_embedding(req.pooled, len(req.origin_input_ids), pooling)
            req.pooled = None
            req.finished_reason = FinishReason("stop")
            self.finish(req)
        return StepOutcome(
            stepped=reqs,
            decode_tokens=0,
            forward_seconds=forward_seconds,
            decoded=False,
            prefill_report=prefill_report,
        )

    @staticmethod
    def _first_scheduled(reqs: list[Req], now: float) -> dict:
        """Stamp the requests this step schedules for the first time (their prefix-cache hit is what their
        first step found in KV); the prefill's figures for the reporter."""
        new_seqs = queries = hits = 0
        for req in reqs:
            if req.scheduled_ts is None:
                req.scheduled_ts = now
                req.cached_tokens = req.kv_len
                new_seqs += 1
                queries += len(req.origin_input_ids)
                hits += req.kv_len
        return dict(
            new_seqs=new_seqs,
            new_tokens=sum(r.extend_len for r in reqs),
            cached_tokens=hits,
            prefix_queries=queries,
            prefix_hits=hits,
        )

    def decode(self, reqs: list[Req]) -> StepOutcome:
        """One token for each running request, or a verify step where some of them draft."""
        drafts = self._propose(reqs, len(reqs))
        if drafts is not None:
            return self._verify(reqs, drafts)
        batch = self.builder.decode(reqs)
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        forward_seconds = time.perf_counter() - t0
        self._observe(0, len(reqs), forward_seconds, decode=reqs)
        for req in reqs:
            req.kv_len += 1
        self._sample_and_append(logits, reqs)
        return StepOutcome(reqs, len(reqs), forward_seconds)

    def _propose(self, reqs: list[Req], step_tokens: int, prefill_tokens: int = 0) -> list[list[int]] | None:
        """The running requests' drafts for this step (None: no request drafts): as many KV slots as the
        pool can spare beyond the `step_tokens` the step takes anyway."""
        spare = self.allocator.available_size() + self.tree_cache.evictable_size() - step_tokens
        drafts = self.spec.propose(reqs, spare, prefill_tokens=prefill_tokens)
        self.reporter.on_draft_budget(self.spec.k_in_effect)
        return drafts

    def _verify(self, reqs: list[Req], drafts: list[list[int]]) -> StepOutcome:
        """A decode step in which some requests have drafts: one extend step feeds each of them its newest
        token and its drafts, the others their newest token alone (sampled as in a decode step). A drafting
        request appends its accepted drafts and one more token, stopping where a stop condition is met; the
        KV slots of positions whose token it did not append go back to the allocator, so its KV still covers
        exactly `kv_token_ids` and nothing rejected can reach the prefix cache."""
        verifying = [r for r, d in zip(reqs, drafts, strict=True) if d]
        runs = [d for d in drafts if d]
        plain = [r for r, d in zip(reqs, drafts, strict=True) if not d]
        batch = self.builder.verify(verifying, runs, plain)
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        forward_seconds = time.perf_counter() - t0
        self._observe(0, batch.num_tokens, forward_seconds, decode=reqs, drafts=drafts)
        verify_rows = batch.num_tokens - len(plain)
        taken = self._accept_drafts(logits[:verify_rows], verifying, runs, batch.out_cache_loc[:verify_rows])
        for req in plain:
            req.kv_len += 1
        if plain:
            self._sample_and_append(logits[verify_rows:], plain)
        return StepOutcome(reqs, sum(taken) + len(plain), forward_seconds)

    def _accept_drafts(
        self, logits: torch.Tensor, verifying: list[Req], runs: list[list[int]], fed_slots: torch.Tensor
    ) -> list[int]:
        """The drafting requests' part of a verify step (`SpecDecoder.accept`), its figures reported and the
        requests it finished handed to `finish`. Returns how many tokens each took."""
        taken, totals = self.spec.accept(
            logits, verifying, runs, fed_slots, self.allocator, self.eos_token_ids, self.context_len
        )
        self.reporter.on_verify(totals)
        for req in verifying:
            if req.finished:
                self.finish(req)
        return taken

    def _sample_and_append(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        mask = self.grammar.mask(reqs)
        out = self.sampler.sample(logits, reqs, mask)
        append_tokens(out, reqs, time.monotonic(), self.eos_token_ids, self.context_len)
        if mask is not None:
            self.grammar.advance(reqs, out.next_token_ids, mask)
        for req in reqs:
            if req.finished:
                self.finish(req)

    def _observe(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        seconds: float,
        prefill: Sequence[Req] = (),
        decode: Sequence[Req] = (),
        drafts: list[list[int]] | None = None,
    ) -> None:
        """The step's cost to the mixed-chunk cost model, with the keys its rows attended to (read before
        the step's `kv_len` updates: a verifying request's rows, its drafts and one more, all at about its
        context)."""
        if self.mixed_budget is not None:
            rows = (
                zip(decode, (len(d) + 1 for d in drafts), strict=True) if drafts else ((r, 1) for r in decode)
            )
            keys = attention_keys(
                chain(((r.kv_len, r.extend_len) for r in prefill), ((r.kv_len, n) for r, n in rows))
            )
            self.mixed_budget.observe(prefill_tokens, decode_tokens, seconds, keys)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(STEP_DEBUG_LINE, prefill_tokens, decode_tokens, seconds * 1e3)
