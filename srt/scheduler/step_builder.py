"""Chosen requests -> the step's `ForwardBatch` (SGLang's ScheduleBatch role): KV slots allocated, each
request's `req_to_token` row written (the invariant `ForwardBatch` states), index tensors built, each step by
`forward_batch_info.lay_out` (the one layout every kind of step shares).

The scheduler decides *what* runs; this module decides *how it is laid out*:
- extend: the prefill requests' new tokens, concatenated;
- mixed: an extend batch whose tail is the running batch's decode, one token per request with its whole
  prefix in the pool (SGLang builds mixed batches the same way), `num_decode` telling the backend where
  the tail starts;
- decode: one token per running request;
- verify (speculative decoding): an extend batch in which each drafting request feeds its newest token and
  its k drafts over its cached prefix, followed by the step's other running requests with their newest
  token alone; the model returns logits for every row (`ForwardBatch.logit_rows`). Where the runner
  replays decode steps from CUDA graphs, a verify step that fits them is laid out as decode rows instead:
  each fed token a sequence of its own, over its request's `req_to_token` row up to and including its own
  position, so the causal mask falls out of the lengths and the step replays a decode graph (on an H200 an
  eager extend of a few tokens took 18 ms where a replayed decode step of as many rows took 3).

Every tensor of the batch lives on the device of the pools (the runner's): index lists are uploaded through
`IndexUploader` (pinned staging and asynchronous copies on CUDA, plain tensors on the CPU), and the
`req_to_token` writes index the table with device tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, lay_out
from srt.scheduler.index_upload import IndexUploader
from srt.scheduler.schedule_batch import Req


class StepBuilder:
    def __init__(
        self,
        req_to_token_pool,
        allocator,
        tree_cache,
        adapter_slots: Callable[[list[Req]], list[int]] | None = None,
        verify_rows_as_decode: int = 0,
    ):
        """`adapter_slots` (multi-LoRA on): each of a step's requests' adapter slot, in the step's order.
        `verify_rows_as_decode`: lay out verify steps of at most this many rows as decode rows (the runner's
        largest decode graph; 0: never)."""
        self.verify_rows_as_decode = verify_rows_as_decode
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.adapter_slots = adapter_slots
        self.uploader = IndexUploader(allocator.device)
        self._all_rows = torch.arange(0, dtype=torch.int64, device=allocator.device)  # grown on demand

    def alloc_kv(self, n: int) -> torch.Tensor:
        short = n - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        loc = self.allocator.alloc(n)
        if loc is None:  # admission and retraction keep this from happening; a bug if it does
            raise RuntimeError(f"KV pool exhausted: need {n}, free {self.allocator.available_size()}")
        return loc

    def extend(self, prefill: list[Req], decode: list[Req], **extra) -> ForwardBatch:
        """Prefill requests (planned: `kv_len`/`extend_len` set) followed, when `decode` is not empty, by
        the decoding requests of a mixed step. `extra`: prompt-logprob fields, whose rows index the
        prefill part (which comes first)."""
        up = self.uploader
        up.begin_step()
        self._give_rows(prefill)
        reqs = prefill + decode
        new_lens = [r.extend_len for r in prefill] + [1] * len(decode)
        loc = self.alloc_kv(sum(new_lens))
        input_ids = self._prefill_ids(prefill)
        input_ids.extend(r.output_ids[-1] for r in decode)
        batch = lay_out(
            ForwardMode.MIXED if decode else ForwardMode.EXTEND,
            self.req_to_token_pool,
            [r.req_pool_idx for r in reqs],
            [r.kv_len for r in reqs],
            input_ids,
            new_lens,
            loc,
            up,
            num_decode=len(decode),
            lora_slots=self._lora_slots(reqs),
            **extra,
        )
        up.end_step()
        return batch

    def decode(self, reqs: list[Req]) -> ForwardBatch:
        up = self.uploader
        up.begin_step()
        loc = self.alloc_kv(len(reqs))
        batch = lay_out(
            ForwardMode.DECODE,
            self.req_to_token_pool,
            [r.req_pool_idx for r in reqs],
            [r.kv_len for r in reqs],
            [r.output_ids[-1] for r in reqs],
            [1] * len(reqs),
            loc,
            up,
            lora_slots=self._lora_slots(reqs),
        )
        up.end_step()
        return batch

    def verify(
        self, reqs: list[Req], drafts: list[list[int]], plain: list[Req], prefill: list[Req] | None = None
    ) -> ForwardBatch:
        """Each of `reqs` feeds its newest token and then its `drafts` (k_i + 1 rows from position kv_len),
        then each of `plain` its newest token; every one of those rows' logits is returned, in this order.
        With `prefill` (planned as for `extend`), a mixed step: their new tokens come first, and the logits of
        each one's last row lead the returned rows."""
        up = self.uploader
        up.begin_step()
        prefill = prefill or []
        self._give_rows(prefill)
        everyone = prefill + reqs + plain
        new_lens = [r.extend_len for r in prefill] + [len(d) + 1 for d in drafts] + [1] * len(plain)
        num_rows = sum(new_lens)
        loc = self.alloc_kv(num_rows)
        input_ids = self._prefill_ids(prefill)
        for req, run in zip(reqs, drafts, strict=True):
            input_ids.append(req.output_ids[-1])
            input_ids.extend(run)
        input_ids.extend(r.output_ids[-1] for r in plain)
        prefix_lens = [r.kv_len for r in everyone]
        if not prefill and num_rows <= self.verify_rows_as_decode:
            batch = self._decode_rows(everyone, new_lens, prefix_lens, input_ids, loc)
            up.end_step()
            return batch
        if self._all_rows.numel() < num_rows:
            self._all_rows = torch.arange(2 * num_rows, dtype=torch.int64, device=self._all_rows.device)
        fed = sum(new_lens[len(prefill) :])
        rows = self._all_rows[num_rows - fed : num_rows]
        if prefill:  # each prefill sequence's last row, then every fed row
            ends = list(itertools.accumulate(new_lens[: len(prefill)]))
            rows = torch.cat([up.upload("prefill_last_rows", [e - 1 for e in ends]), rows])
        batch = lay_out(
            ForwardMode.EXTEND,
            self.req_to_token_pool,
            [r.req_pool_idx for r in everyone],
            prefix_lens,
            input_ids,
            new_lens,
            loc,
            up,
            logit_rows=rows,
            lora_slots=self._lora_slots(everyone),
        )
        up.end_step()
        return batch

    def _decode_rows(
        self,
        reqs: list[Req],
        new_lens: list[int],
        prefix_lens: list[int],
        input_ids: list[int],
        loc: torch.Tensor,
    ) -> ForwardBatch:
        """A verify step's rows as a decode batch (see the module docstring): the row at position p of a
        request reads that request's first p + 1 slots, which hold its cached prefix, the rows fed before it
        and its own K/V (written by the layer before it attends). Logits come back for every row, in order."""
        slots = self._lora_slots(reqs)
        if slots is not None:  # each request's slot on each of its rows
            slots = list(itertools.chain.from_iterable(map(itertools.repeat, slots, new_lens)))
        table_rows = itertools.chain.from_iterable(
            map(itertools.repeat, (r.req_pool_idx for r in reqs), new_lens)
        )
        positions = itertools.chain.from_iterable(
            map(range, prefix_lens, (p + n for p, n in zip(prefix_lens, new_lens, strict=True)))
        )
        return lay_out(
            ForwardMode.DECODE,
            self.req_to_token_pool,
            list(table_rows),
            list(positions),
            input_ids,
            [1] * len(input_ids),
            loc,
            self.uploader,
            lora_slots=slots,
        )

    def _give_rows(self, prefill: list[Req]) -> None:
        """A `req_to_token` row, holding its cached prefix's slots, for each prefill request without one."""
        for req in prefill:
            if req.req_pool_idx is None:
                req.req_pool_idx = self.req_to_token_pool.alloc(1)[0]
                self.req_to_token_pool.write((req.req_pool_idx, slice(0, req.kv_len)), req.prefix_indices)

    @staticmethod
    def _prefill_ids(prefill: list[Req]) -> list[int]:
        """The prefill requests' new tokens, concatenated: what a step feeds them."""
        ids: list[int] = []
        for req in prefill:
            ids.extend(req.fill_ids[req.kv_len : req.kv_len + req.extend_len])
        return ids

    def _lora_slots(self, reqs: list[Req]) -> list[int] | None:
        return None if self.adapter_slots is None else self.adapter_slots(reqs)
