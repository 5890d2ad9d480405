"""Speculative decoding in the scheduler (`--speculative-algorithm`, OpenAI's `prediction`;
docs/speculative_decoding.md): which running requests draft in a decode step, how many drafts each may take,
and judging the drafts against the target model's rows.

Where drafts come from: a request that carries a prediction drafts from it, and where the prediction has
nothing from its own tokens by NGRAM's lookup (on every server: it is the request's own parameter); the
others from `--speculative-algorithm`'s proposer, when the server has one. The step executor runs the
verify step (`StepExecutor._verify`, srt/scheduler/step_executor.py); the model-free parts (proposers,
lossless verification, the figures) live in `srt/speculative/`.

Eligibility, decided every step: a request drafts unless it is constrained by a grammar, whose matcher would
have to be advanced over the drafts and rolled back; such a request decodes plainly in the same forward step
instead (one row, the ordinary sampler), so its output is exactly what it is without speculation.

An eligible request's rows are sampled as a plain step's row is, each after its own context (the output and
the drafts before it), by the scheduler's isolating sampler (`IsolatingSampler.verify`, over
srt/sampling/verify_rows.py): a request whose verify-step sampling raises finishes with `error` alone and
the others keep their tokens, as in a plain step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from srt.scheduler.token_append import append_token_runs
from srt.speculative.defaults import (
    DRAFT_MODEL_ALGORITHM,
    GPU_VERIFY_STEP_TOKENS,
    PREDICTION_DRAFTS_PER_STEP,
    drafts_for_batch,
)
from srt.speculative.ngram import NgramProposer
from srt.speculative.prediction import PredictionProposer
from srt.speculative.proposer import Proposer, draft_len_limit
from srt.speculative.stats import SpecRequestStats, SpecStep, SpecStepStats

if TYPE_CHECKING:
    from srt.model_executor.model_runner import ModelRunner
    from srt.scheduler.schedule_batch import Req
    from srt.scheduler.step_sampler import IsolatingSampler
    from srt.server_args import ServerArgs


def may_speculate(req: Req) -> bool:
    """Whether the request may take drafts this step (see the module docstring)."""
    return req.grammar is None


def build_proposer(args: ServerArgs, k: int, target: ModelRunner) -> Proposer:
    """NGRAM's lookup, or STANDALONE's draft model on its own runner: the served model's device, dtype and
    quantization, a KV pool as large as the target's (drafts are never longer than what it holds) and as
    many request rows. A draft model whose vocabulary differs from the target's cannot share its tokenizer:
    refused in one line at start-up."""
    if args.speculative_algorithm != DRAFT_MODEL_ALGORITHM:
        return NgramProposer(
            min_n=args.speculative_ngram_min_match_window_size,
            max_n=args.speculative_ngram_max_match_window_size,
            k=k,
        )
    from srt.model_executor.model_runner import ModelRunner
    from srt.model_executor.runner_config import RunnerConfig
    from srt.speculative.draft_model import DraftModelProposer

    draft_config = RunnerConfig(
        model_dir=args.speculative_draft_model_path,
        dtype=str(target.dtype).removeprefix("torch."),
        device=target.device,
        max_total_tokens=target.max_total_num_tokens,
        max_running_requests=target.max_running_requests,
        context_length=target.context_len,
        quantization=target.quantization,
        random_seed=args.random_seed,
    )
    draft = ModelRunner(draft_config)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"--speculative-draft-model-path: the draft model's vocabulary ({draft.vocab_size} tokens) is not "
            f"the served model's ({target.vocab_size}); a draft model must share its tokenizer"
        )
    return DraftModelProposer(draft, k)


def verify_step_tokens(runner_max_tokens: int) -> int:
    """The most tokens a verify step may feed on a runner whose steps take `runner_max_tokens` at about a
    decode step's cost (`ModelRunner.verify_max_tokens`; 0: no bound of its own), and never more than
    GPU_VERIFY_STEP_TOKENS. On the CPU, what the fused decode step takes: there a fed token costs ~0.6 ms on
    top of a ~7.5 ms step, past it the step takes the extend path and costs about a prefill of its tokens (a
    decode step of 16 sequences 22 ms, their verify step of 64 tokens ~55 ms). Measured on a 2-core AMD EPYC
    Zen 4 (scripts/bench_spec.py): with 64 on the CPU, concurrency 16 ran at 0.89x of no speculation; with
    16, 1.01x. 8 drafts at batch 1, 3 at 4, 1 at 8, none from 9. On a GPU with graphs, no more than the
    largest graph: its verify rows replay as a decode step (`StepBuilder.verify_rows_as_decode`), where an
    eager extend costs several decode steps."""
    if runner_max_tokens:
        return min(GPU_VERIFY_STEP_TOKENS, runner_max_tokens)
    return GPU_VERIFY_STEP_TOKENS


class SpecDecoder:
    """Built for every scheduler: any request may carry a prediction. Without `--speculative-algorithm`
    a decode step in which no running request has one costs one scan of the batch here."""

    def __init__(self, args: ServerArgs, sampler: IsolatingSampler, context_len: int, target: ModelRunner):
        self.k = args.speculative_drafts_per_step  # 0 without --speculative-algorithm
        self.k_in_effect = self.k  # at the latest decode step's batch size (`drafts_for_batch`)
        # the most a verify step feeds
        self.step_tokens = verify_step_tokens(target.verify_max_tokens)
        self.proposer = build_proposer(args, self.k, target) if args.speculative_algorithm else None
        min_n, max_n = (
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
        )
        # a prediction's requests also look up their own tokens, by NGRAM's windows
        own_tokens = NgramProposer(min_n=min_n, max_n=max_n, k=PREDICTION_DRAFTS_PER_STEP)
        self.predictions = PredictionProposer(max_n=max_n, own_tokens=own_tokens)
        # the requests whose drafts of the current step came from their prediction (OpenAI's usage fields)
        self._from_prediction: set[str] = set()
        self.sampler = sampler
        self.context_len = context_len

    def propose(
        self, reqs: Sequence[Req], spare_slots: int, prefill_tokens: int = 0
    ) -> list[list[int]] | None:
        """Per request of `reqs`, its drafts for this step (empty: it decodes plainly), or None when no
        request has one. Each request takes at most `drafts_for_batch(k, len(reqs))` (k: the algorithm's,
        or PREDICTION_DRAFTS_PER_STEP for a request with a prediction): fewer as the batch grows, none past
        it (speculation steps aside where a verify step would cost more than it saves). A request never
        drafts past its max_new_tokens or the context (`draft_len_limit`), and all drafts together take at
        most `spare_slots` KV slots (beyond the one per request a decode step takes anyway): under memory
        pressure speculation shrinks instead of forcing a retraction. In a mixed step the prefill's
        `prefill_tokens` count against the step's budget too: next to a prefill chunk the step is bound by
        computing, where every rejected draft costs as much as a prompt token."""
        bs = len(reqs)
        budget = self.step_tokens - prefill_tokens
        # the gauge's k: the algorithm's, or on a server without one the predictions'
        self.k_in_effect = drafts_for_batch(self.k or PREDICTION_DRAFTS_PER_STEP, bs, budget)
        if self.proposer is None and not any(r.prediction_ids for r in reqs):
            return None
        if spare_slots <= 0:
            return None
        chosen = [i for i, r in enumerate(reqs) if may_speculate(r)]
        predicted = [i for i in chosen if reqs[i].prediction_ids]
        guessed = [i for i in chosen if not reqs[i].prediction_ids] if self.proposer is not None else []
        out: list[list[int]] = [[] for _ in reqs]
        found = 0
        self._from_prediction.clear()
        for proposer, which, most in (
            (self.predictions, predicted, PREDICTION_DRAFTS_PER_STEP),
            (self.proposer, guessed, self.k),
        ):
            k = drafts_for_batch(most, bs, budget) if which else 0
            if k == 0:
                continue
            limits = [draft_len_limit(k, self._tokens_left(reqs[i])) for i in which]
            drafts = proposer.propose([reqs[i] for i in which], limits)
            sourced = drafts.from_prediction or (False,) * len(which)
            for i, ids, predicted in zip(which, drafts.token_ids, sourced, strict=True):
                out[i] = ids[: max(spare_slots, 0)]
                if predicted and out[i]:
                    self._from_prediction.add(reqs[i].rid)
                spare_slots -= len(out[i])
                found += len(out[i])
        return out if found else None

    def _tokens_left(self, req: Req) -> int:
        """Tokens the request may still produce: its max_new_tokens left, and room left in the context."""
        return min(
            req.remaining_new_tokens, self.context_len - len(req.origin_input_ids) - len(req.output_ids)
        )

    def verify(
        self, logits: torch.Tensor, reqs: Sequence[Req], drafts: Sequence[list[int]]
    ) -> tuple[list[list[int]], list[int]]:
        """Judge each request's drafts (every one non-empty) against its k + 1 rows of `logits`, packed request
        after request, through the isolating sampler (`IsolatingSampler.verify`): per request, the tokens to
        append and how many drafts were accepted; a request whose sampling raised is finished with `error`
        and gets none."""
        return self.sampler.verify(logits, reqs, drafts)

    def accept(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        drafts: Sequence[list[int]],
        fed_slots: torch.Tensor,
        allocator,
        eos_token_ids: frozenset[int],
        context_len: int,
    ) -> tuple[list[int], SpecStepStats]:
        """The verify step's outcome for its drafting requests (`logits`, `fed_slots`: their rows and KV
        slots, request after request): judge the drafts, append each request's accepted drafts and the token
        after them one at a time with the stop checks (`append_token_runs`), its logprobs and penalty counts,
        give the KV slots of every fed position whose token was not appended back to `allocator` (so a
        request's KV covers exactly its tokens and nothing rejected can reach the prefix cache), and record
        the figures. Returns how many tokens each request took, and the step's totals."""
        tokens, accepted = self.verify(logits, reqs, drafts)
        logprobs = self.sampler.run_logprobs(logits, reqs, drafts, tokens)
        starts = [len(r.output_ids) for r in reqs]
        taken = append_token_runs(tokens, list(reqs), time.monotonic(), eos_token_ids, context_len, logprobs)
        self.sampler.record_runs(reqs, tokens, taken)
        rejected: list[int] = []
        row = 0
        for req, run, n in zip(reqs, drafts, taken, strict=True):
            rejected.extend(range(row + n, row + len(run) + 1))  # fed positions whose token was not kept
            req.kv_len += n
            row += len(run) + 1
        if rejected:
            allocator.free(fed_slots[torch.tensor(rejected, device=fed_slots.device)])
        # only what is output counts: a stop token, EOS or max_tokens inside an accepted run drops the rest
        steps = [
            SpecStep(start, len(run), a, req.rid in self._from_prediction).cut(start + n)
            for req, run, a, start, n in zip(reqs, drafts, accepted, starts, taken, strict=True)
        ]
        for req, step in zip(reqs, steps, strict=True):
            if step is None:
                continue
            if req.spec_stats is None:
                req.spec_stats = SpecRequestStats()
            # a stop string, which the detokenizer finds later (in this step's message at the earliest), may
            # still cut it
            req.spec_stats.record(step, may_be_cut=bool(req.sampling_params.stop))
        return taken, SpecStepStats.from_steps(steps)

    def release(self, rid: str) -> None:
        """The request left for good (finished or aborted; not retracted)."""
        self.predictions.release(rid)
        if self.proposer is not None:
            self.proposer.release(rid)
