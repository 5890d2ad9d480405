"""A minimal stand-in for the scheduler, for model tests: it owns the pools' bookkeeping (request rows, KV
slots) and runs extend/decode steps, laid out by `lay_out` as the scheduler's are, through a ModelRunner."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from srt.model_executor.forward_batch_info import ForwardMode, FreshTensors, lay_out
from srt.model_executor.model_runner import ModelRunner


@dataclass
class Seq:
    row: int  # req_to_token row
    kv_len: int = 0  # tokens whose KV is in the pool
    owned_slots: list[torch.Tensor] = field(default_factory=list)  # slots this sequence allocated
    adapter: str | None = None  # the LoRA adapter it runs with (the runner's `lora` must have it loaded)


@dataclass
class GreedyTrace:
    tokens: list[int]
    top2_gaps: list[float]  # top-1 minus top-2 logit at each step: small = a near-tie


class PagedDriver:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    @classmethod
    def on_empty_pools(cls, runner: ModelRunner) -> PagedDriver:
        """A driver over the runner's pools emptied of what earlier steps left (no sequence, no KV slot held)."""
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        return cls(runner)

    def new_seq(self, adapter: str | None = None) -> Seq:
        rows = self.runner.req_to_token_pool.alloc(1)
        assert rows is not None, "no free request rows"
        return Seq(row=rows[0], adapter=adapter)

    def share_prefix(self, dst: Seq, src: Seq, length: int) -> None:
        """Point dst's first `length` tokens at src's KV slots, as a radix-cache hit does."""
        pool = self.runner.req_to_token_pool
        pool.write((dst.row, slice(0, length)), pool.req_to_token[src.row, :length])
        dst.kv_len = length

    def release(self, seq: Seq) -> None:
        for slots in seq.owned_slots:
            self.runner.token_to_kv_pool_allocator.free(slots)
        self.runner.req_to_token_pool.free(seq.row)

    def extend(self, seqs: list[Seq], new_tokens: list[list[int]], every_row: bool = False) -> torch.Tensor:
        """Logits of each sequence's last new token, or with `every_row` of every new token (a verify step)."""
        return self._step(ForwardMode.EXTEND, seqs, new_tokens, every_row=every_row)

    def decode(self, seqs: list[Seq], tokens: list[int]) -> torch.Tensor:
        return self._step(ForwardMode.DECODE, seqs, [[t] for t in tokens])

    def mixed(
        self, extend_seqs: list[Seq], new_tokens: list[list[int]], decode_seqs: list[Seq], tokens: list[int]
    ) -> torch.Tensor:
        """One mixed step, as the scheduler lays it out: the extends first, then one token per decoder."""
        return self._step(
            ForwardMode.MIXED, extend_seqs + decode_seqs, new_tokens + [[t] for t in tokens], len(decode_seqs)
        )

    def _step(
        self,
        mode: ForwardMode,
        seqs: list[Seq],
        new_tokens: list[list[int]],
        num_decode: int = 0,
        every_row: bool = False,
    ) -> torch.Tensor:
        counts = [len(t) for t in new_tokens]
        slots = self.runner.token_to_kv_pool_allocator.alloc(sum(counts))
        assert slots is not None, "KV pool exhausted"
        offsets = [0, *itertools.accumulate(counts)]
        for seq, start, end in zip(seqs, offsets, offsets[1:], strict=False):
            seq.owned_slots.append(slots[start:end])
        batch = lay_out(
            mode,
            self.runner.req_to_token_pool,
            [s.row for s in seqs],
            [s.kv_len for s in seqs],
            [t for ts in new_tokens for t in ts],
            counts,
            slots,
            FreshTensors(self.runner.device),
            num_decode=num_decode,
            logit_rows=torch.arange(sum(counts), device=self.runner.device) if every_row else None,
            lora_slots=self.runner.lora.prepare_step([s.adapter for s in seqs]) if self.runner.lora else None,
        )
        logits = self.runner.forward(batch)
        for seq, n in zip(seqs, counts, strict=True):
            seq.kv_len += n
        return logits

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[GreedyTrace]:
        """Greedy-decode all prompts together: one extend step, then batched decode steps."""
        seqs = [self.new_seq() for _ in prompts]
        traces = [GreedyTrace([], []) for _ in prompts]
        logits = self.extend(seqs, prompts)
        for _ in range(max_new_tokens):
            top2 = logits.topk(2, dim=-1)
            next_ids = top2.indices[:, 0].tolist()
            for trace, token, values in zip(traces, next_ids, top2.values.tolist(), strict=True):
                trace.tokens.append(token)
                trace.top2_gaps.append(values[0] - values[1])
            if len(traces[0].tokens) == max_new_tokens:
                break
            logits = self.decode(seqs, next_ids)
        for seq in seqs:
            self.release(seq)
        return traces


def same_or_diverged_at_a_near_tie(got: list[int], want: list[int], gaps: list[float], tie: float) -> bool:
    """True when two greedy token lists are equal. Otherwise asserts that they first differ at a near-tie (the
    top-1 minus top-2 logit gap at that step, `gaps[step]`, under `tie`) and returns False: a flip there is
    legitimate, and past it the two decode different contexts."""
    diverged = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if diverged is None:
        return True
    assert gaps[diverged] < tie, (
        f"{got[: diverged + 1]} vs {want[: diverged + 1]} diverge at step {diverged} where the top-2 logit gap "
        f"is {gaps[diverged]:.2e} (not a near-tie)"
    )
    return False
