"""Which rows of a step run with which adapter, worked out once per step for every adapted layer.

The step's token rows come in the scheduler's order, sequences of different adapters interleaved. Every
layer multiplies the adapted rows as a few dense segments instead: `order` lists the adapted rows grouped
by adapter slot, and each `Segment` is one adapter's run of it. A layer gathers `x[order]` once, does one
shrink and one expand per segment, and adds the deltas back at `order`: no Python loop over sequences, and
rows on the base (NO_ADAPTER) are never touched. A step whose every row has an adapter, already grouped (a
batch of one, or of one adapter), needs neither the gather nor the scatter: its `order` is None.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from srt.model_executor.forward_batch_info import NO_ADAPTER


@dataclass(frozen=True)
class Segment:
    slot: int  # the adapter's slot in the weight pool
    rank: int  # the adapter's own rank: the pool's padding beyond it is never multiplied
    start: int  # its rows are order[start:end]
    end: int


@dataclass(frozen=True)
class LoRABatchInfo:
    order: torch.Tensor | None  # int64 [adapted rows] on the model's device: step rows grouped by slot
    segments: tuple[Segment, ...]
    table: torch.Tensor  # int64 [segments, 4] on the CPU: each (slot, rank, start, end), for the CPU kernel
    device: torch.device  # the model's

    @staticmethod
    def build(
        seq_slots: Sequence[int], new_token_counts: Sequence[int], slot_ranks: Sequence[int], device
    ) -> LoRABatchInfo | None:
        """From each sequence's slot and its number of rows in the step; None when no row has an adapter.
        Worked out on lists: a step has at most a few hundred rows, and the handful of tensor ops this took
        cost ~0.1 ms a step right after a forward, a few % of a batch-1 adapter step."""
        row_slots = [slot for slot, n in zip(seq_slots, new_token_counts, strict=True) for _ in range(n)]
        adapted = [row for row, slot in enumerate(row_slots) if slot != NO_ADAPTER]
        if not adapted:
            return None
        order = sorted(adapted, key=row_slots.__getitem__)  # stable: each sequence's rows stay in order
        segments, start = [], 0
        while start < len(order):
            slot, end = row_slots[order[start]], start
            while end < len(order) and row_slots[order[end]] == slot:
                end += 1
            segments.append(Segment(slot, slot_ranks[slot], start, end))
            start = end
        in_place = len(adapted) == len(row_slots) and order == adapted
        table = torch.tensor([(s.slot, s.rank, s.start, s.end) for s in segments], dtype=torch.int64)
        rows = None if in_place else torch.tensor(order, dtype=torch.int64, device=device)
        return LoRABatchInfo(rows, tuple(segments), table, torch.device(device))

    @functools.cached_property  # read by every adapted layer of a Triton-backend step; other backends never copy it
    def device_table(self) -> torch.Tensor:
        """`table` on the model's device, where the Triton kernels read it."""
        return self.table if self.device.type == "cpu" else self.table.to(self.device)

    @functools.cached_property  # read by every adapted layer of the step
    def max_segment_rows(self) -> int:
        """The longest segment's rows, which size the Triton kernels' grids."""
        return max(s.end - s.start for s in self.segments)

    def kernel_segments(self) -> tuple[int | None, int, int]:
        """srt_lora_add_segments' step operands (rows, nseg, seg) by address: the same for every adapted layer
        of the step, so the fused decode step and the layers' own calls pass them alike."""
        rows = None if self.order is None else self.order.data_ptr()
        return rows, self.table.shape[0], self.table.data_ptr()


class LoRAStep:
    """The current step's `LoRABatchInfo`, shared by every adapted layer. The runner is its only writer, once
    per step before the forward pass (`ModelRunner` through `LoRAManager.begin_step`); layers only read it."""

    def __init__(self):
        self.info: LoRABatchInfo | None = None
