"""The scheduler's view of a request (`Req`) and the step's output message built from a list of them.

A `Req` owns its token ids, its lengths and its event timestamps; everything else is derived. The KV of a
request covers `kv_token_ids` = (prompt + output)[:kv_len]: the newest sampled token has no KV until it is fed
back in the next decode step.
"""

from __future__ import annotations

import time

import torch

from srt.io_struct import BatchTokenIDOut, FinishReason
from srt.sampling.sampling_params import SamplingParams
from srt.speculative.stats import SpecRequestStats

EMPTY_INDICES = torch.empty(0, dtype=torch.int64)


class Req:
    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        stream: bool = False,
        generator: torch.Generator | None = None,
    ):
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.stream = stream
        self.generator = generator
        self.penalty_row: int | None = None  # row in the sampler's PenaltyPool while it runs, if penalized
        self.grammar = None  # structured output: this request's matcher (srt/constrained/)
        # A thinking request's end-tag id: its grammar waits until that token is in its output, then this
        # is None (docs/reasoning.md, "Constraints")
        self.think_end_id: int | None = None
        self.stop_after_reasoning: str | None = None  # its stop strings skip the thinking (io_struct)
        self.trace = None  # its tracing stamps (scheduler_tracing.ReqTrace) when the request is traced
        self.output_ids: list[int] = []
        self.finished_reason: FinishReason | None = None

        # Memory: row in ReqToTokenPool, locked prefix from the cache, tokens whose KV is written.
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = EMPTY_INDICES
        self.last_node = None
        self.kv_len = 0
        # Prefill in progress: tokens to put into KV this round and how many the current step extends.
        self.fill_ids: list[int] = []
        self.extend_len = 0
        self.cached_tokens = 0  # prompt tokens served by the prefix cache at first scheduling

        # Events on this process's monotonic clock (docs/metrics.md, "Per-request intervals").
        self.queued_ts = time.monotonic()
        self.scheduled_ts: float | None = None
        self.first_token_ts: float | None = None
        self.last_token_ts: float | None = None
        self.num_retractions = 0
        self.spec_stats: SpecRequestStats | None = None  # its speculative figures, from its first verify step
        self.prediction_ids: list[int] | None = None  # OpenAI's Predicted Outputs: its drafts come from these
        self.lora_name: str | None = None  # its LoRA adapter (None: the base model)

        # Output not yet sent to the detokenizer, with the step stamp of each token.
        self.sent_len = 0
        self.pending_ts: list[float] = []
        self.pending_logprobs: list[float] = []
        self.pending_top_logprobs: list[list[tuple[int, float]]] = []
        # Prompt logprobs (`logprob_start_len`): gathered over the prefill's chunks, sent once when complete.
        self.input_logprobs: list[float | None] | None = None
        self.input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
        self.prompt_logprobs_done = False
        self.prompt_logprobs_sent = False
        # An embedding server's (--is-embedding; srt/scheduler/pooling.py): what the prompt's chunks pooled so
        # far, then the finished vector, sent with the final output.
        self.pooled: torch.Tensor | None = None
        self.embedding: bytes | None = None

    # ---- derived ----
    @property
    def seq_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def kv_token_ids(self) -> list[int]:
        return self.seq_ids[: self.kv_len]

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_indices)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def is_chunked(self) -> bool:
        """True while a prefill is split over steps and more of `fill_ids` remains after the step being
        planned (`extend_len` is reset to 0 once the step has run)."""
        return self.kv_len + self.extend_len < len(self.fill_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Asked for prompt logprobs not computed yet (a retracted request keeps those it has)."""
        return self.sampling_params.logprob_start_len is not None and not self.prompt_logprobs_done

    @property
    def logprob_first_row(self) -> int:
        """First prompt position whose logits a prompt logprob needs (position p predicts token p + 1)."""
        return max(self.sampling_params.logprob_start_len, 1) - 1

    @property
    def prefix_match_len(self) -> int:
        """How much of `fill_ids` the prefix cache may serve: all but the token fed to get the next one, and
        with prompt logprobs pending nothing from `logprob_first_row` on (a cached prefix has no logits, so
        the positions asked for are recomputed; the cache drops the duplicate KV when the request ends)."""
        limit = len(self.fill_ids) - 1
        if self.prompt_logprobs_pending:
            limit = min(limit, self.logprob_first_row)
        return limit

    def prompt_logprob_positions(self) -> range:
        """Positions of the step being planned whose logits give a prompt logprob (of the next prompt token)."""
        if not self.prompt_logprobs_pending:
            return range(0)
        end = min(self.kv_len + self.extend_len, len(self.origin_input_ids) - 1)
        return range(max(self.kv_len, self.logprob_first_row), max(end, self.kv_len))

    def add_prompt_logprobs(self, values: list[float], tops: list[list[tuple[int, float]]]) -> None:
        """Append one prefill step's prompt logprobs; complete once every prompt token from
        logprob_start_len on has its entry (the prompt's first token has None: nothing predicts it)."""
        start = self.sampling_params.logprob_start_len
        if self.input_logprobs is None:
            self.input_logprobs = [None] if start == 0 else []
            self.input_top_logprobs = [None] if start == 0 else []
        self.input_logprobs.extend(values)
        self.input_top_logprobs.extend(tops)
        self.prompt_logprobs_done = len(self.input_logprobs) >= len(self.origin_input_ids) - start

    def reset_prefix(self) -> None:
        """Forget an unlocked prefix match (the request was not admitted after all)."""
        self.prefix_indices, self.last_node, self.kv_len = EMPTY_INDICES, None, 0

    def prepare_fill(self) -> None:
        """Before (re)admission: everything but the newest token must be in KV; the newest one is fed to get
        the next token. A resumed request thus re-prefills its prompt and the output it already has."""
        self.fill_ids = self.seq_ids

    # ---- finishing ----
    def check_finished(self, eos_token_ids: frozenset[int], context_len: int) -> None:
        """Stop conditions the scheduler owns (stop strings belong to the detokenizer)."""
        params = self.sampling_params
        n_out = len(self.output_ids)
        if n_out == 0:
            return
        last = self.output_ids[-1]
        if n_out >= params.min_new_tokens:
            if last in params.stop_token_ids:
                self.finished_reason = FinishReason("stop", matched=last)
                return
            if not params.ignore_eos and last in eos_token_ids:
                self.finished_reason = FinishReason("stop", matched=last)
                return
        if n_out >= params.max_new_tokens:
            self.finished_reason = FinishReason("length")
        elif len(self.origin_input_ids) + n_out >= context_len:
            self.finished_reason = FinishReason("length", message="reached the model's context length")

    def append_token(self, token_id: int, step_ts: float, logprob: float | None, top: list | None) -> None:
        self.output_ids.append(token_id)
        self.pending_ts.append(step_ts)
        if token_id == self.think_end_id:
            self.think_end_id = None  # the thinking ended: the grammar starts with the next token
        if logprob is not None:
            self.pending_logprobs.append(logprob)
            self.pending_top_logprobs.append(top or [])
        if self.first_token_ts is None:
            self.first_token_ts = step_ts
        self.last_token_ts = step_ts

    def due_for_output(self, stream_interval: int) -> bool:
        """First token at once (TTFT is observed when it is produced), then every `stream_interval` tokens
        when streaming, and always on finish. A request with stop strings reports every step's tokens,
        streamed or not: only the detokenizer can tell that one ended it, and the abort it then causes
        stops the request a step or two later instead of at max_tokens."""
        pending = len(self.output_ids) - self.sent_len
        if self.finished:
            return True
        if pending == 0:
            return False
        if self.sent_len == 0 or self.sampling_params.stop:
            return True
        return self.stream and pending >= stream_interval

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)}, kv={self.kv_len})"


def build_token_output(reqs: list[Req]) -> BatchTokenIDOut:
    """The step's message to the detokenizer: each request's tokens since its last message, its finish reason
    and the stamps the metrics need. Marks what it took as sent."""
    want_logprobs = any(r.sampling_params.logprobs is not None for r in reqs)
    want_input = any(r.prompt_logprobs_done and not r.prompt_logprobs_sent for r in reqs)
    # figures travel with the final message, and with each message a stop string may end (the detokenizer
    # then cuts them: SpecRequestStats.truncate)
    want_spec = any(r.spec_stats is not None and (r.finished or r.sampling_params.stop) for r in reqs)
    out = BatchTokenIDOut(
        rids=[],
        output_ids=[],
        finished_reasons=[],
        prompt_tokens=[],
        completion_tokens=[],
        cached_tokens=[],
        queued_ts=[],
        scheduled_ts=[],
        first_token_ts=[],
        token_ts=[],
        num_retractions=[],
        output_token_logprobs=[] if want_logprobs else None,
        output_top_logprobs=[] if want_logprobs else None,
        input_token_logprobs=[] if want_input else None,
        input_top_logprobs=[] if want_input else None,
        spec_stats=[] if want_spec else None,
        embeddings=[] if any(r.embedding is not None for r in reqs) else None,
    )
    if any(r.stop_after_reasoning is not None for r in reqs):
        out.stop_after_reasoning = [r.stop_after_reasoning for r in reqs]
    for req in reqs:
        out.rids.append(req.rid)
        out.output_ids.append(req.output_ids[req.sent_len :])
        out.finished_reasons.append(req.finished_reason)
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.completion_tokens.append(len(req.output_ids))
        out.cached_tokens.append(req.cached_tokens)
        out.queued_ts.append(req.queued_ts)
        out.scheduled_ts.append(req.scheduled_ts)
        out.first_token_ts.append(req.first_token_ts)
        out.token_ts.append(req.pending_ts)
        out.num_retractions.append(req.num_retractions)
        out.skip_special_tokens.append(req.sampling_params.skip_special_tokens)
        out.stop_strs.append(req.sampling_params.stop)
        if want_logprobs:
            out.output_token_logprobs.append(req.pending_logprobs)
            out.output_top_logprobs.append(req.pending_top_logprobs)
            req.pending_logprobs, req.pending_top_logprobs = [], []
        if want_input:
            ready = req.prompt_logprobs_done and not req.prompt_logprobs_sent
            out.input_token_logprobs.append(req.input_logprobs if ready else None)
            out.input_top_logprobs.append(req.input_top_logprobs if ready else None)
            if ready:
                req.prompt_logprobs_sent = True
                req.input_logprobs = req.input_top_logprobs = None
        if want_spec:
            cuttable = req.spec_stats is not None and (req.finished or req.sampling_params.stop)
            out.spec_stats.append(req.spec_stats.hand_off() if cuttable else None)
        if out.embeddings is not None:
            out.embeddings.append(req.embedding)
        req.sent_len = len(req.output_ids)
        req.pending_ts = []
    return out
