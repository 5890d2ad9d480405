"""DetokenizerManager: turns the scheduler's token ids into text deltas, one request at a time, incrementally.

Why a separate process: detokenization and stop-string matching are pure CPU string work that would otherwise
steal time from the scheduler's forward loop or the HTTP event loop.

Invariants of the text it emits (per request, the concatenation of all deltas):
- never a broken multi-byte character: text that decodes to a trailing U+FFFD is held back until the
  next token completes the character (or the request finishes);
- never any part of a stop string: a matched stop string and everything after it are cut, and while
  streaming a tail that could still grow into a stop string is held back.

Fault isolation: an entry whose decoding or stop matching raises (a malformed stop list, a token the tokenizer
rejects) finishes that request with `error` and one log line; the rest of the batch is converted as usual and
the request's later entries are dropped. Only MemoryError ends the process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

import zmq

from srt.io_struct import BatchOutMeta, BatchStrOut, BatchTokenIDOut, FinishReason
from srt.port_args import PortArgs
from srt.process_logging import configure_process_logging
from srt.reasoning.parser import REASONING_FORMATS, ReasoningStream
from srt.server_args import ServerArgs
from srt.sockets import get_zmq_socket
from srt.speculative.stats import SpecRequestStats
from srt.tokenizer_loading import load_tokenizer

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Per-request fields both output batches share (every BatchOutMeta field), copied entry by entry.
_META_FIELDS = tuple(f.name for f in fields(BatchOutMeta))
# Fields holding one value per new token: cut with the output when a stop string ends the request early.
_PER_TOKEN_FIELDS = ("output_ids", "token_ts", "output_token_logprobs", "output_top_logprobs")
# Fields that are None for a whole batch when no request in it asked for them.
_OPTIONAL_FIELDS = (
    "output_token_logprobs",
    "output_top_logprobs",
    "input_token_logprobs",
    "input_top_logprobs",
    "spec_stats",
    "embeddings",
)


@dataclass
class DecodeState:
    """Incremental decode state of one request.

    `ids[surr_offset:read_offset]` is a window already turned into text; decoding it together with the newer
    ids and subtracting its own text gives the new text, which keeps tokenizers that merge neighbouring
    tokens (leading spaces, byte pieces) exact without re-decoding the whole output every step."""

    ids: list[int] = field(default_factory=list)
    surr_offset: int = 0
    read_offset: int = 0
    text: str = ""  # confirmed text (no trailing partial character), stop strings not yet cut
    sent: int = 0  # characters of `text` already emitted
    stopped: bool = False  # finished by a stop string; later outputs are dropped
    # A reasoning model's request: stop strings match from `answer_start` on, once the reader has seen the
    # thinking end (None until then); `read` characters of `text` were fed to the reader.
    reader: ReasoningStream | None = None
    answer_start: int | None = 0
    read: int = 0


class IncrementalDetokenizer:
    """Per-request decode and stop-string logic, free of sockets so it can be unit tested."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _push_token(self, st: DecodeState, token: int, skip: bool) -> None:
        st.ids.append(token)
        surr = self._decode(st.ids[st.surr_offset : st.read_offset], skip)
        new = self._decode(st.ids[st.surr_offset :], skip)
        if new.endswith(REPLACEMENT_CHAR):
            return  # a multi-byte character is not complete yet
        st.text += new[len(surr) :]
        st.surr_offset = st.read_offset
        st.read_offset = len(st.ids)

    def _flush_partial(self, st: DecodeState, skip: bool) -> None:
        """At the end of a request, emit whatever is pending even if it is an incomplete character."""
        if st.read_offset < len(st.ids):
            surr = self._decode(st.ids[st.surr_offset : st.read_offset], skip)
            new = self._decode(st.ids[st.surr_offset :], skip)
            st.text += new[len(surr) :]
            st.surr_offset = st.read_offset = len(st.ids)

    @staticmethod
    def _find_stop(st: DecodeState, stops: list[str]) -> tuple[int, str] | None:
        """Earliest stop string in the unsent part of the text (a match may begin in already sent text only
        if it was held back, so searching from `sent` minus the longest stop is enough)."""
        if not stops or st.answer_start is None:
            return None
        start = max(0, st.sent - max(len(s) for s in stops) + 1, st.answer_start)
        best: tuple[int, str] | None = None
        for s in stops:
            pos = st.text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    @staticmethod
    def _holdback(text: str, stops: list[str]) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        hold = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    @staticmethod
    def _read_thinking(st: DecodeState) -> None:
        """Feed the reader the new text; when the thinking has ended, the answer starts after the end tag
        (or at 0: the output opened no thinking)."""
        st.reader.feed(st.text[st.read :])
        st.read = len(st.text)
        if st.reader.reasoning_ended:
            tag = st.reader.fmt.end_tag
            end = st.text.find(tag)
            st.answer_start = end + len(tag) if end >= 0 else 0

    def fail(self, rid: str, finished: bool, exc: Exception) -> FinishReason:
        """An entry of `rid` raised: log it once, forget the request's text and drop its later entries until
        the scheduler's final one."""
        logger.error("Request %s failed while detokenizing: %s: %s", rid, type(exc).__name__, exc)
        logger.debug("Traceback of request %s's failure", rid, exc_info=exc)
        if finished:
            self.states.pop(rid, None)
        else:
            self.states[rid] = DecodeState(stopped=True)
        return FinishReason("error", message=f"failed while detokenizing: {type(exc).__name__}: {exc}")

    def step(
        self,
        rid: str,
        new_ids: list[int],
        finished: FinishReason | None,
        stops: list[str],
        skip_special_tokens: bool,
        stop_after_reasoning: str | None = None,
    ) -> tuple[str, int, FinishReason | None] | None:
        """Consume one batch entry. Returns (text delta, tokens consumed from `new_ids`, finish reason) or
        None when the entry must be dropped (the request already stopped on a stop string)."""
        st = self.states.get(rid)
        if st is None:
            st = self.states[rid] = DecodeState()
            if stop_after_reasoning is not None:
                st.reader = REASONING_FORMATS[stop_after_reasoning].new_stream()
                st.answer_start = None
        if st.stopped:
            if finished is not None:
                del self.states[rid]
            return None
        for i, token in enumerate(new_ids):
            self._push_token(st, token, skip_special_tokens)
            if finished is not None and i == len(new_ids) - 1:
                self._flush_partial(st, skip_special_tokens)
            if st.answer_start is None:
                self._read_thinking(st)
            match = self._find_stop(st, stops)
            if match is not None:
                pos, stop = match
                delta = st.text[st.sent : pos] if pos > st.sent else ""
                st.sent = max(st.sent, pos)
                if finished is None:
                    st.stopped = True
                else:
                    del self.states[rid]
                return delta, i + 1, FinishReason("stop", matched=stop)
        if finished is not None and not new_ids:
            self._flush_partial(st, skip_special_tokens)
        if finished is not None:
            delta = st.text[st.sent :]
            del self.states[rid]
            return delta, len(new_ids), finished
        end = len(st.text) - self._holdback(st.text[st.sent :], stops)
        delta = st.text[st.sent : end] if end > st.sent else ""
        st.sent = max(st.sent, end)
        return delta, len(new_ids), None


def _final_figures(
    stats: SpecRequestStats, reason: FinishReason | None, completion_tokens: int
) -> SpecRequestStats | None:
    """A request's speculative figures go on with its final entry only, counting only the completion's
    positions: a stop string found here may end the output inside a verify step's run, or before steps the
    scheduler already counted (srt/speculative/stats.py)."""
    if reason is None:
        return None
    stats.truncate(completion_tokens)
    return stats


class DetokenizerManager:
    """Receives BatchTokenIDOut, sends BatchStrOut; forwards every other message unchanged."""

    def __init__(self, tokenizer, recv_sock: zmq.Socket, send_sock: zmq.Socket, tracing=None):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.tracing = tracing  # srt/tracing/detokenizer_tracer.py's DetokenizerTracing with --enable-trace
        self.recv_sock = recv_sock
        self.send_sock = send_sock

    def convert(self, batch: BatchTokenIDOut) -> BatchStrOut | None:
        """One BatchStrOut for one BatchTokenIDOut; entries of requests that already stopped are dropped and
        an entry finished by a stop string is cut after the token that completed it."""
        out: dict[str, list] = {name: [] for name in _META_FIELDS}
        strs: list[str] = []
        if batch.trace_contexts is not None and self.tracing is not None:
            self.tracing.on_batch(batch)
        for i, rid in enumerate(batch.rids):
            finished = batch.finished_reasons[i]
            try:
                stops = batch.stop_strs[i] if batch.stop_strs else []
                skip = batch.skip_special_tokens[i] if batch.skip_special_tokens else True
                after = batch.stop_after_reasoning[i] if batch.stop_after_reasoning else None
                res = self.detok.step(rid, batch.output_ids[i], finished, stops, skip, after)
            except MemoryError:
                raise
            except Exception as e:
                res = "", 0, self.detok.fail(rid, finished is not None, e)
            if res is None:
                continue
            delta, used, reason = res
            if reason is not None and self.tracing is not None:
                self.tracing.on_finished(rid)
            unused = len(batch.output_ids[i]) - used
            for name in _META_FIELDS:
                values = getattr(batch, name)
                value = None if values is None else values[i]
                if name in _PER_TOKEN_FIELDS and value is not None:
                    value = value[:used]
                elif name == "finished_reasons":
                    value = reason
                elif name == "completion_tokens":
                    value -= unused
                elif name == "spec_stats" and value is not None:
                    value = _final_figures(value, reason, batch.completion_tokens[i] - unused)
                out[name].append(value)
            strs.append(delta)
        if not strs:
            return None
        for name in _OPTIONAL_FIELDS:
            if getattr(batch, name) is None:
                out[name] = None
        return BatchStrOut(**out, output_strs=strs)

    def event_loop(self) -> None:
        while True:
            msg = self.recv_sock.recv_pyobj()
            if isinstance(msg, BatchTokenIDOut):
                out = self.convert(msg)
                if out is not None:
                    self.send_sock.send_pyobj(out)
            else:
                self.send_sock.send_pyobj(msg)


def run_detokenizer_process(
    server_args: ServerArgs, port_args: PortArgs, model_dir: str, ready_writer
) -> None:
    """Entry point of the spawned detokenizer: load the tokenizer, report ready (True or an error string)."""
    configure_process_logging(server_args.log_level, "detokenizer")
    try:
        tokenizer = load_tokenizer(server_args.tokenizer_path or model_dir)
        context = zmq.Context()
        recv_sock = get_zmq_socket(context, zmq.PULL, port_args.detokenizer_input, bind=True)
        send_sock = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_input, bind=False)
        tracing = None
        if server_args.enable_trace:
            from srt.tracing.detokenizer_tracer import DetokenizerTracing

            tracing = DetokenizerTracing(server_args)
        manager = DetokenizerManager(tokenizer, recv_sock, send_sock, tracing)
    except Exception as e:  # report any start-up failure to the launcher instead of dying silently
        logger.exception("detokenizer failed to start")
        ready_writer.send(f"detokenizer failed to start: {e}")
        return
    ready_writer.send(True)
    ready_writer.close()
    if server_args.metrics_enabled:
        from srt.metrics.collector import start_process_metrics

        start_process_metrics("detokenizer", {"model_name": server_args.model_name})
    logger.info("detokenizer ready")
    manager.event_loop()
