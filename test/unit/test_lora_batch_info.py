"""A step's rows grouped by adapter, once per step: the adapted rows in slot order (each sequence's rows kept in
order), one segment per adapter with its rank, base rows left out; nothing to regroup when every row has an
adapter already grouped, and no work at all when no row has one."""

from __future__ import annotations

from srt.lora.batch_info import LoRABatchInfo, Segment
from srt.model_executor.forward_batch_info import NO_ADAPTER

RANKS = [8, 16, 0]  # per slot


def test_adapted_rows_are_grouped_by_slot_and_base_rows_left_out():
    # sequences: base (rows 0-1), slot 1 (row 2), slot 0 (rows 3-5), slot 1 (row 6)
    info = LoRABatchInfo.build([NO_ADAPTER, 1, 0, 1], [2, 1, 3, 1], RANKS, "cpu")
    assert info.order.tolist() == [3, 4, 5, 2, 6]
    assert info.segments == (
        Segment(slot=0, rank=8, start=0, end=3),
        Segment(slot=1, rank=16, start=3, end=5),
    )


def test_rows_already_grouped_need_no_gather():
    info = LoRABatchInfo.build([1, 1, 0], [1, 1, 1], RANKS, "cpu")
    assert info.order is not None  # slot 1 before slot 0: regrouped
    info = LoRABatchInfo.build([0, 0, 1], [3, 1, 2], RANKS, "cpu")
    assert info.order is None
    assert info.segments == (Segment(0, 8, 0, 4), Segment(1, 16, 4, 6))


def test_a_step_of_the_base_alone_has_no_batch_info():
    assert LoRABatchInfo.build([NO_ADAPTER, NO_ADAPTER], [4, 1], RANKS, "cpu") is None


def test_the_order_keeps_each_sequences_rows_and_the_first_slot_seen_does_not_lead():
    # slot 2 appears first but slot 0 sorts first; equal slots keep their rows' order (a stable grouping)
    ranks = [4, 8, 16]
    info = LoRABatchInfo.build([2, 0, NO_ADAPTER, 2, 0], [2, 1, 1, 2, 2], ranks, "cpu")
    assert info.order.tolist() == [2, 6, 7, 0, 1, 4, 5]
    assert info.segments == (Segment(0, 4, 0, 3), Segment(2, 16, 3, 7))
    assert info.table.tolist() == [[0, 4, 0, 3], [2, 16, 3, 7]]
