"""TokenizerManager: the main process's side of the ZMQ ring.

It tokenizes requests (through its InputProcessor), sends them to the scheduler, and routes the detokenizer's
batched outputs (through output_dispatch.py) back to the waiting HTTP handlers (one asyncio queue per HTTP
request, shared by its `n` samples). It also writes every request-level metric, on the main process's clock
(docs/metrics.md, "Per-request intervals").

A request with `n > 1` (or several prompts) becomes one internal request per sample, each with its own rid;
they share the prompt, so the scheduler's prefix cache computes it once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from srt.constrained.judge import GrammarJudge
from srt.http_server.dp_router import DataParallelRouter
from srt.http_server.input_processor import (
    ClientDisconnected,
    GenerateInput,
    InputProcessor,
    InvalidRequestError,
    ServerUnavailableError,
)
from srt.http_server.lora_registry import LoRARegistry
from srt.http_server.openai.chat_reasoning import ReasoningReading
from srt.http_server.output_dispatch import ReqOutput, dispatch_batch
from srt.http_server.req_state import ReqState
from srt.http_server.request_metrics import RequestMetricsRecorder
from srt.io_struct import (
    AbortReq,
    BatchStrOut,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    LoRAAdapterReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from srt.lora.specs import allowed_adapter_dirs, lora_enabled, startup_adapters
from srt.metrics.request_stats import FinishedRequestStats
from srt.port_args import PortArgs
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.sockets import get_zmq_socket
from srt.tokenizer_loading import load_tokenizer

logger = logging.getLogger(__name__)

# How often a waiting handler checks whether its HTTP client went away.
DISCONNECT_POLL_SECONDS = 0.5
# How long /flush_cache waits for the scheduler's reply.
FLUSH_CACHE_TIMEOUT_SECONDS = 30.0


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, model_dir: str, tokenizer=None):
        self.server_args = server_args
        self.port_args = port_args
        self.model_dir = model_dir
        if tokenizer is None:
            tokenizer = load_tokenizer(server_args.tokenizer_path or model_dir)
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.inputs = InputProcessor(tokenizer, server_args.grammar_backend)
        # the constraint judge (srt/constrained/judge.py), on the tokenizer's vocabulary until the scheduler's
        self.judge = GrammarJudge(
            server_args.grammar_backend,
            server_args.tokenizer_path or model_dir,
            self.vocab_size,
            self._tokenizer_eos(),
            server_args.grammar_compile_timeout,
        )
        self.ready: SchedulerReady | None = None
        self.rid_to_state: dict[str, ReqState] = {}
        self.group_rids: dict[str, list[str]] = {}
        self.dead_reason: str | None = None
        self.metrics: RequestMetricsRecorder | None = None
        self.tracer = None  # srt/tracing/request_tracer.py's RequestTracer, with --enable-trace
        self._flush_waiters: deque[asyncio.Future] = deque()
        self._recv_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, for the launcher's watchdog
        # Sending is synchronous (unbounded HWM, never blocks) so an abort can be sent from a `finally`
        # that runs while the handler is being cancelled.
        self._sync_ctx = zmq.Context()
        # One input socket per data-parallel scheduler; the router picks one per request.
        self.send_socks = [
            get_zmq_socket(self._sync_ctx, zmq.PUSH, port_args.scheduler_input_for(rank), bind=False)
            for rank in range(server_args.dp_size)
        ]
        self.router = DataParallelRouter(server_args.dp_size, server_args.load_balance_method)
        # the served LoRA adapters (--enable-lora; docs/lora.md)
        self.lora = (
            LoRARegistry(
                server_args.model_name,
                startup_adapters(server_args.lora_paths, server_args.lora_modules),
                self._send_to_all,
                server_args.dp_size,
                allowed_adapter_dirs(server_args),
            )
            if lora_enabled(server_args)
            else None
        )
        self._async_ctx: zmq.asyncio.Context | None = None
        self.recv_sock = None

    # ---- lifecycle ----
    def set_ready(self, ready: SchedulerReady) -> None:
        """Record the scheduler's limits and create the request-level metrics (needs the context length)."""
        self.ready = ready
        self.inputs.set_limits(ready.context_len, ready.max_req_input_len)
        self.judge.bind(ready.vocab_size or self.vocab_size, ready.eos_token_ids or self._tokenizer_eos())
        self.inputs.set_judge(self.judge)
        args = self.server_args
        reading = ReasoningReading.for_server(args.reasoning_parser, args.reasoning_field, self.tokenizer)
        self.metrics = RequestMetricsRecorder(args, ready.context_len, reading)
        if self.server_args.enable_trace:  # the SDK is imported only then (srt/tracing/)
            from srt.tracing.request_tracer import RequestTracer

            self.tracer = RequestTracer(self.server_args)

    def _tokenizer_eos(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [eos]

    async def start(self) -> None:
        """Bind the PULL socket and start the output dispatcher; call inside the server's event loop."""
        self.loop = asyncio.get_running_loop()
        if self.inputs.judge is not None:
            self.inputs.judge.start()  # in the background: ready before the first constrained request
        self._async_ctx = zmq.asyncio.Context()
        self.recv_sock = get_zmq_socket(self._async_ctx, zmq.PULL, self.port_args.tokenizer_input, bind=True)
        self._recv_task = asyncio.create_task(self._recv_loop(), name="tokenizer-recv")

    async def stop(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self.recv_sock is not None:
            self.recv_sock.close()
        for sock in self.send_socks:
            sock.close()
        if self.metrics is not None:
            self.metrics.close()  # writes the request export's queued lines
        self.judge.close()

    @property
    def context_len(self) -> int:
        assert self.ready is not None, "set_ready() must run before requests are served"
        return self.ready.context_len

    # ---- requests ----
    def check(self, obj: GenerateInput) -> list[SamplingParams]:
        """Each prompt's checked sampling params. Handlers call it, through `generate`, before they commit
        to a (streaming) response, so bad input gets a 400 status."""
        if self.dead_reason is not None:
            raise ServerUnavailableError(self.dead_reason)
        rank = obj.data_parallel_rank
        if rank is not None and not 0 <= rank < self.router.dp_size:
            raise InvalidRequestError(
                f"`data_parallel_rank` {rank} is out of range: this server runs --dp-size "
                f"{self.router.dp_size} (ranks 0 to {self.router.dp_size - 1})",
                "data_parallel_rank",
            )
        return self.inputs.check(obj)

    def _internal_rids(self, obj: GenerateInput) -> tuple[str, list[str]]:
        """The request's group rid and one rid per sample; refused if any of them is in use, whatever its
        origin (a client's rid, or the `-i` suffix of another request's samples)."""
        group = obj.rid or uuid.uuid4().hex
        total = len(obj.prompts) * obj.n
        rids = [group] if total == 1 else [f"{group}-{i}" for i in range(total)]
        taken = [r for r in {group, *rids} if r in self.group_rids or r in self.rid_to_state]
        if taken:
            raise InvalidRequestError(
                f"request id {obj.rid!r} collides with a running request ({taken[0]!r})", "rid"
            )
        return group, rids

    def generate(
        self, obj: GenerateInput, request=None, *, health_check: bool = False
    ) -> AsyncIterator[ReqOutput]:
        """Check and send the request(s) now — so a bad or duplicate request raises here, before any response
        is committed — and return an iterator over the outputs, tagged with their choice index.

        `request` (a Starlette Request) is polled for a disconnect; a disconnect, a cancellation or an
        early close of the iterator aborts every unfinished internal request in the scheduler. An iterator
        never consumed leaves its requests to finish on their own (bounded by max_new_tokens).
        `health_check` requests are left out of the request export."""
        per_prompt = self.check(obj)
        group, rids = self._internal_rids(obj)
        queue: asyncio.Queue[ReqOutput] = asyncio.Queue()
        self.group_rids[group] = rids
        labels = self.metrics.custom_labels(request.headers if request is not None else None)
        export = not health_check
        traces = (
            None
            if self.tracer is None or health_check
            else self.tracer.begin(obj, per_prompt[0], group, rids, request)
        )
        for i, rid in enumerate(rids):
            p = i // obj.n
            ids, params = obj.prompts[p], per_prompt[p]
            self.rid_to_state[rid] = ReqState(
                rid, i, queue, obj.arrival_ts, len(ids), params.max_new_tokens, obj.n, group,
                labels=labels, params=params, export=export, lora_name=obj.lora_name, thinking=obj.thinking,
            )  # fmt: skip
            if params.logprob_start_len is not None:
                self.rid_to_state[rid].logprob_ids = ids[params.logprob_start_len :]
            text = obj.input_texts[p] if obj.input_texts else None
            rank = self.router.route(rid, obj.data_parallel_rank)
            trace = traces[i] if traces else None
            self.send_socks[rank].send_pyobj(
                TokenizedGenerateReqInput(
                    rid,
                    ids,
                    params,
                    obj.stream,
                    text,
                    trace,
                    obj.prediction_ids,
                    obj.lora_name,
                    think_end_id=obj.think_end_id,
                    stop_after_reasoning=obj.stop_after_reasoning,
                )
            )
        return self._outputs(queue, rids, request, export)

    async def _outputs(
        self, queue: asyncio.Queue, rids: list[str], request, export: bool
    ) -> AsyncIterator[ReqOutput]:
        """The final output of each request is stamped as handed to the response (and exported) here, as
        the handler gets it; finals never taken (the handler went away) are exported unstamped."""
        unfinished = set(rids)
        try:
            while unfinished:
                item = await self._next(queue, request)
                if item.finish_reason is not None:
                    unfinished.discard(item.rid)
                    self.metrics.handed_over(item.stats, export)
                yield item
        finally:
            for rid in unfinished:
                self._abandon(rid)
            while not queue.empty():
                left = queue.get_nowait()
                if left.stats is not None and export:
                    self.metrics.export(left.stats)

    async def _next(self, queue: asyncio.Queue, request) -> ReqOutput:
        if not queue.empty() or request is None:
            return await queue.get()
        while True:
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                if await request.is_disconnected():
                    raise ClientDisconnected() from None

    def _abandon(self, rid: str) -> None:
        """The handler stopped listening: abort in the scheduler; keep the state until the final entry
        arrives so the request is still counted (as aborted) in the metrics."""
        st = self.rid_to_state.get(rid)
        if st is None:
            return
        st.abandoned = True
        if self.dead_reason is None:
            logger.info("aborting request %s (client gone)", rid)
            self._send_abort(AbortReq(rid))

    def abort_all(self) -> None:
        """Abort every request (`/abort_request {"abort_all": true}`)."""
        self._send_abort(AbortReq(""))

    def abort_request(self, rid: str) -> bool:
        """Abort a request by the rid the client knows (all its samples) or one sample's rid."""
        rids = list(self.group_rids.get(rid, [rid] if rid in self.rid_to_state else []))
        for r in rids:
            self._send_abort(AbortReq(r))
        return bool(rids)

    def _send_to_all(self, msg) -> None:
        """A control message every data-parallel scheduler must apply (adapter loads and unloads)."""
        for sock in self.send_socks:
            sock.send_pyobj(msg)

    def _send_abort(self, req: AbortReq) -> None:
        for rank in self.router.ranks_for_abort(req.rid):
            self.send_socks[rank].send_pyobj(req)

    async def flush_cache(self) -> FlushCacheReqOutput:
        if self.dead_reason is not None:
            raise ServerUnavailableError(self.dead_reason)
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in self.send_socks]
        self._flush_waiters.extend(futs)
        for sock in self.send_socks:
            sock.send_pyobj(FlushCacheReq())
        replies = await asyncio.wait_for(asyncio.gather(*futs), FLUSH_CACHE_TIMEOUT_SECONDS)
        failed = [r for r in replies if not r.success]
        return failed[0] if failed else replies[0]

    def fail_all(self, reason: str) -> None:
        """A child died: fail every in-flight request at once instead of letting it hang."""
        if self.dead_reason is None:
            self.dead_reason = reason
        if self.tracer is not None:
            self.tracer.fail_all(reason, time.monotonic())
        for st in list(self.rid_to_state.values()):
            if not st.abandoned:
                st.queue.put_nowait(
                    ReqOutput(
                        st.index,
                        st.rid,
                        "",
                        [],
                        FinishReason("error", message=reason),
                        st.prompt_tokens,
                        0,
                        0,
                    )
                )
        self.rid_to_state.clear()
        self.group_rids.clear()
        while self._flush_waiters:
            fut = self._flush_waiters.popleft()
            if not fut.done():
                fut.set_exception(ServerUnavailableError(reason))
        if self.lora is not None:
            self.lora.fail_all(reason)

    # ---- outputs ----
    async def _recv_loop(self) -> None:
        while True:
            msg = await self.recv_sock.recv_pyobj()
            try:
                if isinstance(msg, BatchStrOut):
                    dispatch_batch(msg, self.rid_to_state, self.metrics, self._finish)
                elif isinstance(msg, FlushCacheReqOutput):
                    self._handle_flush(msg)
                elif isinstance(msg, LoRAAdapterReqOutput) and self.lora is not None:
                    self.lora.on_reply(msg)
                else:
                    logger.warning("unexpected message %s", type(msg).__name__)
            except Exception:  # one bad message must not stop every future request's outputs
                logger.exception("failed to dispatch %s", type(msg).__name__)

    def _handle_flush(self, msg: FlushCacheReqOutput) -> None:
        while self._flush_waiters:
            fut = self._flush_waiters.popleft()
            if not fut.done():
                fut.set_result(msg)
                return

    def _finish(self, st: ReqState, reason: FinishReason, stats: FinishedRequestStats) -> None:
        del self.rid_to_state[st.rid]
        if all(r not in self.rid_to_state for r in self.group_rids.get(st.group, ())):
            self.group_rids.pop(st.group, None)  # its last sample finished: the rid may be used again
        if reason.type == "error" or (reason.type == "stop" and isinstance(reason.matched, str)):
            # The detokenizer may have ended it (a stop string, or a failure it isolated) while the scheduler
            # still generates for it; an abort of a request the scheduler already finished is a no-op.
            self._send_abort(AbortReq(st.rid, silent=True))
        self.router.finished(st.rid)
        self.metrics.on_finish(st, stats)
        if self.tracer is not None:
            self.tracer.on_finish(st, stats, reason)
