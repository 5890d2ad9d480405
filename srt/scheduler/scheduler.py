"""The scheduler: continuous batching over the paged KV pool and the prefix cache, driven one step at a time.

`Scheduler.step()` runs one forward step — a prefill (extend) batch when waiting work fits, otherwise a decode
batch of every running request — and returns the step's `BatchTokenIDOut`. It knows nothing of sockets, so
tests drive it in-process; `scheduler_process.py` wraps it in the ZMQ loop.

Fault isolation (`fault_isolation.py`): an exception while admitting one request, sampling its row or checking
its stop conditions finishes *that* request with `error` (one log line with its rid), frees its memory, and
the step goes on for everyone else. Failures that are not one request's (out of memory, a broken KV-pool
invariant, a forward pass that raises) still propagate and end the process.

Test hook (off unless set): with the environment variable `SRT_TEST_FAULT_RID=<substring>` at start-up, a
request whose rid contains the substring raises inside sampling at its `TEST_FAULT_DECODE_STEP`-th decode
step, which lets tests check the isolation end to end. It is read once, here, and kept on the instance.
"""

from __future__ import annotations

import logging
import os

import torch

from srt.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    LoadLoRAAdapterReq,
    LoRAAdapterReqOutput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
)
from srt.mem_cache.kv_events import KVEventSink
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampler import Sampler
from srt.scheduler.fault_isolation import TEST_FAULT_ENV
from srt.scheduler.kv_memory import KVMemory
from srt.scheduler.mixed_chunk import MixedChunkBudget, attention_keys, mixed_chunk_enabled
from srt.scheduler.prefill_admission import PrefillAdmission
from srt.scheduler.request_intake import RequestIntake
from srt.scheduler.schedule_batch import Req, build_token_output
from srt.scheduler.schedule_policy import (
    INIT_NEW_TOKEN_RATIO,
    decayed_new_token_ratio,
    new_token_ratio_after_retraction,
    retract_until_decode_fits,
)
from srt.scheduler.scheduler_grammar import SchedulerGrammar
from srt.scheduler.scheduler_lora import SchedulerLoRA
from srt.scheduler.scheduler_tracing import SchedulerTracing
from srt.scheduler.spec_step import SpecDecoder
from srt.scheduler.step_builder import StepBuilder
from srt.scheduler.step_executor import StepExecutor
from srt.scheduler.step_hooks import NullReporter, SchedulerLoad, StepReporter
from srt.scheduler.step_sampler import IsolatingSampler
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)
TOO_LARGE_FOR_KV = "the KV cache cannot hold this request"


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        model_runner: ModelRunner,
        reporter: StepReporter | None = None,
        kv_events: KVEventSink | None = None,  # --kv-events-config's publisher (srt/kv_events/)
        tracing: SchedulerTracing | None = None,  # --enable-trace's spans (rank 0 only)
    ):
        self.args = server_args
        self.tracing = tracing or SchedulerTracing()
        self.runner = model_runner
        self.reporter = reporter or NullReporter()
        self.memory = KVMemory(server_args, model_runner, self.reporter.residency_observer, kv_events)
        self.req_to_token_pool = self.memory.req_to_token_pool
        self.allocator = self.memory.allocator
        self.tree_cache = self.memory.tree_cache
        self.sampler = IsolatingSampler(
            Sampler(model_runner.vocab_size, model_runner.eos_token_ids, device=model_runner.device),
            test_fault_rid=os.environ.get(TEST_FAULT_ENV) or None,
        )
        self.context_len = model_runner.context_len
        self.max_running_requests = model_runner.max_running_requests
        self.max_req_input_len = min(self.context_len, model_runner.max_total_num_tokens) - 1

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.finished_outside_step: list[Req] = []  # aborts and rejections, reported with the next output
        self.live: dict[str, Req] = {}  # rid -> its request, from admission until its final output
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.last_step_was_prefill = False  # the last step ran a prefill (alone or mixed)
        self.last_step_was_mixed = False
        # mixed prefill/decode steps: their prefill budget, timing-adaptive only without tensor parallelism
        # (every rank must schedule the same batches)
        self.mixed_budget = (
            MixedChunkBudget(adaptive=server_args.tp_size == 1)
            if mixed_chunk_enabled(server_args, model_runner.device)
            else None
        )
        # multi-LoRA (--enable-lora): loads and unloads between steps, each step's adapter slots
        self.lora = (
            SchedulerLoRA(model_runner.lora, self.tree_cache, read_in_loop=server_args.tp_size > 1)
            if model_runner.lora is not None
            else None
        )
        self.intake = RequestIntake(
            self.max_req_input_len, model_runner.vocab_size, server_args.is_embedding,
            torch.Generator(device=model_runner.device).manual_seed(server_args.random_seed),
            self.lora, self.tracing,
        )  # fmt: skip
        self.admission = PrefillAdmission(
            server_args, self.tree_cache, self.allocator, self.req_to_token_pool, self.max_running_requests,
            self.lora,
        )  # fmt: skip
        self.builder = StepBuilder(
            self.req_to_token_pool,
            self.allocator,
            self.tree_cache,
            adapter_slots=self.lora.slots if self.lora is not None else None,
            verify_rows_as_decode=model_runner.decode_graph_max_bs,
        )
        self.grammar = SchedulerGrammar(server_args, model_runner, self.reporter.grammar_metrics)
        # decode steps in which some request drafts (--speculative-algorithm, or a request's `prediction`)
        # become verify steps
        self.spec = SpecDecoder(server_args, self.sampler, self.context_len, model_runner)
        self.executor = StepExecutor(
            model_runner, self.builder, self.tree_cache, self.sampler, self.grammar, self.spec,
            self.reporter, self.tracing, self.mixed_budget, finish=self._finish_in_step,
        )  # fmt: skip

    # ---- inputs ----
    def handle(self, msg) -> FlushCacheReqOutput | LoRAAdapterReqOutput | None:
        """Apply one message from the HTTP process; the reply to send back, if it asks for one."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort_request(msg)
        elif isinstance(msg, FlushCacheReq):
            ok = self.flush_cache()
            return FlushCacheReqOutput(ok, "" if ok else "requests are still running; cache not flushed")
        elif isinstance(msg, LoadLoRAAdapterReq | UnloadLoRAAdapterReq):
            if self.lora is None:
                return LoRAAdapterReqOutput(
                    msg.request_id, False, "LoRA is off: start the server with --enable-lora"
                )
            if isinstance(msg, LoadLoRAAdapterReq):
                self.lora.load(msg)
            else:
                self.lora.unload(msg)
        else:
            logger.warning("Ignoring unknown message %r", type(msg).__name__)
        return None

    def add_request(self, recv: TokenizedGenerateReqInput) -> None:
        """Queue a request (`RequestIntake` builds it), or report it with the next output when it finished at
        once; a constrained request first waits for its grammar."""
        req = self.intake.new_req(recv, self.live)
        if req is None:
            return
        if req.finished:
            self.finished_outside_step.append(req)
        else:
            self.live[req.rid] = req
            if not self.grammar.submit(req):  # a constrained request waits for its grammar
                self.waiting.append(req)
            elif req.finished:
                del self.live[req.rid]
                self.finished_outside_step.append(req)

    def abort_request(self, recv: AbortReq) -> None:
        """Remove a request wherever it is and free its memory; `rid=""` aborts every request."""

        def hit(req: Req) -> bool:
            return recv.rid == "" or req.rid == recv.rid

        for req in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(req)
            self._finish_outside_step(req)
        for req in self.grammar.remove(hit):
            self._finish_outside_step(req)
        if self.chunked_req is not None and hit(self.chunked_req):
            self._release(self.chunked_req)
            self._finish_outside_step(self.chunked_req)
            self.chunked_req = None
        for req in [r for r in self.running if hit(r)]:
            self.running.remove(req)
            self._release(req)
            self._finish_outside_step(req)

    def _finish_outside_step(self, req: Req) -> None:
        req.finished_reason = FinishReason("abort", message="request aborted")
        self.finished_outside_step.append(req)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only allowed when no request holds KV."""
        if not self.is_idle:
            return False
        self.memory.flush()
        return True

    @property
    def is_idle(self) -> bool:
        return not (
            self.waiting
            or self.running
            or self.chunked_req
            or self.grammar.num_queued
            or (self.lora is not None and self.lora.busy)
        )

    @property
    def only_background_work(self) -> bool:
        """Nothing to run until a worker thread finishes: a grammar compiling or an adapter's files being read
        (the loop polls for it at a short period instead of spinning)."""
        return not (self.waiting or self.running or self.chunked_req or self.finished_outside_step) and (
            bool(self.grammar.num_queued) or (self.lora is not None and self.lora.busy)
        )

    def take_replies(self) -> list:
        """Replies to control messages that finished since the last call (adapter loads and unloads)."""
        return self.lora.take_replies() if self.lora is not None else []

    @property
    def num_used_tokens(self) -> int:
        """KV slots held by requests; evictable cache slots count as free."""
        return self.memory.used_tokens()

    def load(self) -> SchedulerLoad:
        """A snapshot of the queues and KV memory, for the reporter."""
        return SchedulerLoad(
            running=len(self.running),
            chunked=self.chunked_req is not None,
            waiting=len(self.waiting),
            used_tokens=self.memory.used_tokens(),
            headroom_tokens=self.memory.headroom(),
            new_token_ratio=self.new_token_ratio,
            idle=self.is_idle,
            lora=self.lora.snapshot(self._holding_kv(), self.waiting) if self.lora is not None else None,
        )

    def _holding_kv(self) -> list[Req]:
        """The running batch and a prompt mid-chunk: the requests whose adapter runs now."""
        return [*self.running, self.chunked_req] if self.chunked_req is not None else self.running

    # ---- one step ----
    def step(self) -> BatchTokenIDOut | None:
        """One forward step. Without mixed chunks: prefill when waiting work fits, else decode — but never two
        prefill steps in a row while requests are decoding: a burst of arrivals would otherwise stall every
        running stream until the whole queue is prefilled (inter-token gaps of tens of seconds on a CPU).
        With mixed chunks (the CPU default; `--enable-mixed-chunk`/`--disable-mixed-chunk`), while requests
        decode, a prefill of at most the mixed budget (srt/scheduler/mixed_chunk.py) rides along in the same
        step as their decode, and a prefill step with nothing decoding is bounded in time too (a request
        arriving meanwhile waits for it). A step that continues a long prompt mid-chunk gets that prefill
        step's budget, decode rows riding along, not the mixed one (prefill_admission.py says why)."""
        stepped: list[Req] = []
        if self.lora is not None and self.lora.busy:
            self.lora.poll(list(self.live.values()), self._holding_kv())
        ready, failed = self.grammar.pop_ready()
        self.waiting.extend(ready)
        self.finished_outside_step.extend(failed)
        if self.mixed_budget is not None and self.running:
            self._ensure_decode_memory()  # first, so admission sees what this step's decode leaves
        if self.mixed_budget is not None and self.running:
            keys = attention_keys((r.kv_len, 1) for r in self.running)
            budget = (
                self.mixed_budget.lone_prefill_tokens(len(self.running), keys, self.chunked_req.kv_len)
                if self.chunked_req is not None
                else self.mixed_budget.prefill_tokens(len(self.running), keys)
            )
            prefill = self._schedule_prefill(token_budget=budget, decode_tokens=len(self.running))
            decode = self.running if prefill else []
        else:
            lone = (
                self.mixed_budget.lone_prefill_tokens(
                    prefix=self.chunked_req.kv_len if self.chunked_req else 0
                )
                if self.mixed_budget is not None
                else None
            )
            prefill = (
                []
                if (self.last_step_was_prefill and self.running)
                else self._schedule_prefill(token_budget=lone)
            )
            decode = []
        if prefill:
            stepped = self._run_extend(prefill, decode)
        elif self.running:
            stepped = self._run_decode()
        self.last_step_was_prefill = bool(prefill)
        self.last_step_was_mixed = bool(decode)
        return self._make_output(stepped)

    def _schedule_prefill(self, token_budget: int | None = None, decode_tokens: int = 0) -> list[Req]:
        """This step's prefill (`PrefillAdmission.admit`), taken off the waiting queue."""
        admitted = self.admission.admit(
            self.waiting, self.running, self.chunked_req, self.new_token_ratio, token_budget, decode_tokens
        )
        self.waiting, self.chunked_req = admitted.waiting, admitted.chunked_req
        return admitted.can_run

    def _run_extend(self, reqs: list[Req], decode: list[Req]) -> list[Req]:
        """A prefill step of `reqs`, or, with `decode` (the running batch), a mixed step (StepExecutor); on an
        embedding server, whose requests all finish in their prefill, a pooling step."""
        if self.args.is_embedding:
            out = self.executor.embed(reqs, self.args.pooling_type)
        else:
            out = self.executor.extend(reqs, decode)
        if out.decoded:
            self._after_decode()
        self.running.extend(r for r in out.prefilled if not r.finished)
        self.reporter.on_prefill(
            self.load(),
            decode_tokens=out.decode_tokens,
            forward_seconds=out.forward_seconds,
            **out.prefill_report,
        )
        return out.stepped

    def _run_decode(self) -> list[Req]:
        """A decode (or verify) step of the running batch, after retracting what its KV cannot hold."""
        self._ensure_decode_memory()
        if not self.running:
            return []
        out = self.executor.decode(self.running)
        self._after_decode()
        self.reporter.on_decode(
            self.load(), num_tokens=out.decode_tokens, forward_seconds=out.forward_seconds
        )
        return out.stepped

    def _after_decode(self) -> None:
        self.running = [r for r in self.running if not r.finished]
        self.new_token_ratio = decayed_new_token_ratio(self.new_token_ratio)

    def _finish_in_step(self, req: Req) -> None:
        """A request that finished during a step: its KV released and its end reported."""
        self._release(req)
        self._report_finished(req)

    def _report_finished(self, req: Req) -> None:
        self.reporter.on_finished(len(req.origin_input_ids), len(req.output_ids), req.cached_tokens)

    def _release(self, req: Req) -> None:
        """A request leaves the running batch: its KV back to the cache (`KVMemory.release`), its sampler row."""
        self.memory.release(req)
        self.sampler.release(req)

    def _ensure_decode_memory(self) -> None:
        """Retract requests (schedule_policy.retract_until_decode_fits) until the next decode step has a KV
        slot for every running request; they keep their output and return to the front of the queue."""
        retracted, too_large = retract_until_decode_fits(
            self.running,
            self.memory.headroom,
            self._release,
        )
        if too_large is not None:
            too_large.finished_reason = FinishReason("length", message=TOO_LARGE_FOR_KV)
            self.finished_outside_step.append(too_large)
        if retracted:
            for req in retracted:
                req.num_retractions += 1
                self.tracing.on_retraction(req)
            self.waiting[:0] = reversed(retracted)
            self.new_token_ratio = new_token_ratio_after_retraction(self.running)
            self.reporter.on_retraction(len(retracted))
            logger.info("Retracted %d request(s); new_token_ratio=%.2f", len(retracted), self.new_token_ratio)

    # ---- outputs ----
    def _make_output(self, stepped: list[Req]) -> BatchTokenIDOut | None:
        reqs = [r for r in stepped if r.due_for_output(self.args.stream_interval)]
        if self.finished_outside_step:
            reqs.extend(self.finished_outside_step)
            self.finished_outside_step = []
        if not reqs:
            return None
        for req in reqs:
            if req.finished and self.live.get(req.rid) is req:
                del self.live[req.rid]
                self.spec.release(req.rid)
        out = build_token_output(reqs)
        self.tracing.on_output(out, reqs)
        return out
