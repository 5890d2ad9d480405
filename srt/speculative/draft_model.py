"""`--speculative-algorithm STANDALONE`: a smaller model with the target's tokenizer drafts each request's
next tokens greedily, on its own ModelRunner and KV pool in the scheduler process.

Its drafts are argmax tokens, so the draft distribution is a point mass (`Drafts.probs` is None) and the
verifier's rule stays lossless for greedy and sampled requests alike.

The draft model's KV per request follows the request's tokens: after a verify step the history (prompt +
accepted output) may diverge from what the draft model last fed (its rejected drafts). Each `propose` keeps
the longest prefix of its cached tokens that is still history, frees the slots of the rest, feeds the
history's new tokens in one batched extend step, then runs batched decode steps for the remaining drafts.
Its steps are laid out by `lay_out`, as the target's are, and its KV follows the target's rule: a sequence's row
holds the slots of exactly its cached `tokens`, and tokens that are not the request's give theirs back. The
request-to-token rows and slots are the draft runner's own: nothing here touches the target's pools (why not
share them as SGLang's draft workers do: docs/architecture.md, "Step layout and the request-to-token table").
When the draft pool cannot hold a step, the step has no drafts (the requests decode plainly) rather than
evicting anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from srt.model_executor.forward_batch_info import ForwardMode, FreshTensors, lay_out
from srt.model_executor.model_runner import ModelRunner
from srt.speculative.proposer import Drafts, Proposer, SpecRequest


@dataclass
class _DraftSeq:
    row: int  # the draft runner's req_to_token row
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the draft pool, in order
    verified: int = 0  # leading `tokens` known to be the request's own (not drafts awaiting verification)


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, k: int):
        self.runner = runner
        self.k = k
        self.seqs: dict[str, _DraftSeq] = {}
        self.upload = FreshTensors(runner.device)

    # ---- the proposer interface ----
    def propose(self, requests: Sequence[SpecRequest], max_lens: Sequence[int]) -> Drafts:
        out: list[list[int]] = [[] for _ in requests]
        active = [i for i, n in enumerate(max_lens) if n > 0]
        seqs: list[_DraftSeq] = []
        feeds: list[list[int]] = []
        for i in active:
            seq = self._seq(requests[i].rid)
            if seq is None:
                return Drafts(out)  # no request row left in the draft runner: no drafts this step
            history = [*requests[i].origin_input_ids, *requests[i].output_ids]
            keep = min(self._common_prefix(seq, history), len(history) - 1)  # the last token is always fed
            self._truncate(seq, keep)
            seqs.append(seq)
            feeds.append(history[keep:])
        if not seqs:
            return Drafts(out)
        with torch.inference_mode():
            logits = self._step(ForwardMode.EXTEND, seqs, feeds)
            if logits is None:
                return Drafts(out)
            for seq in seqs:
                seq.verified = len(seq.tokens)
            current = list(range(len(seqs)))  # positions in `seqs` still drafting, in `logits`' row order
            while True:
                for pos, token in zip(current, logits.argmax(-1).tolist(), strict=True):
                    out[active[pos]].append(token)
                current = [p for p in current if len(out[active[p]]) < max_lens[active[p]]]
                if not current:
                    break
                # each still-drafting request is fed its newest draft
                feeds = [[out[active[p]][-1]] for p in current]
                logits = self._step(ForwardMode.DECODE, [seqs[p] for p in current], feeds)
                if logits is None:
                    break  # the pool is full: the drafts so far stand
        return Drafts(out)

    def release(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self._truncate(seq, 0)
            self.runner.req_to_token_pool.free(seq.row)

    # ---- the draft runner's pools ----
    def _seq(self, rid: str) -> _DraftSeq | None:
        seq = self.seqs.get(rid)
        if seq is None:
            rows = self.runner.req_to_token_pool.alloc(1)
            if rows is None:
                return None
            seq = self.seqs[rid] = _DraftSeq(rows[0])
        return seq

    @staticmethod
    def _common_prefix(seq: _DraftSeq, history: list[int]) -> int:
        """How many of the cached tokens are still the request's: the verified ones (the request's tokens only
        grow), then the drafts as far as the history accepted them."""
        n = min(seq.verified, len(history))
        limit = min(len(seq.tokens), len(history))
        while n < limit and seq.tokens[n] == history[n]:
            n += 1
        return n

    def _truncate(self, seq: _DraftSeq, length: int) -> None:
        if length < len(seq.tokens):
            table = self.runner.req_to_token_pool.req_to_token
            self.runner.token_to_kv_pool_allocator.free(table[seq.row, length : len(seq.tokens)])  # it copies
            del seq.tokens[length:]
        seq.verified = min(seq.verified, length)

    def _step(self, mode: ForwardMode, seqs: list[_DraftSeq], feeds: list[list[int]]) -> torch.Tensor | None:
        """Logits of each sequence's last fed token after feeding `feeds`; None when the pool cannot hold them
        (nothing is fed then)."""
        counts = [len(f) for f in feeds]
        slots = self.runner.token_to_kv_pool_allocator.alloc(sum(counts))
        if slots is None:
            return None
        batch = lay_out(
            mode,
            self.runner.req_to_token_pool,
            [s.row for s in seqs],
            [len(s.tokens) for s in seqs],
            [t for f in feeds for t in f],
            counts,
            slots,
            self.upload,
        )
        logits = self.runner.forward(batch)
        for seq, f in zip(seqs, feeds, strict=True):
            seq.tokens.extend(f)
        return logits
