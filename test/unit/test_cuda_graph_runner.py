"""Which decode batch sizes get a CUDA graph (the replay itself is tested on a GPU: test_cuda_model.py), and
that nothing is captured where graphs cannot run."""

from __future__ import annotations

import bisect
from itertools import pairwise

import pytest

from srt.model_executor.cuda_graph_runner import BATCH_SIZE_STEP, capture_batch_sizes
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs


@pytest.mark.parametrize("max_bs", [1, 2, 3, 8, 9, 160, 256])
def test_every_batch_up_to_the_largest_pads_to_a_captured_size(max_bs):
    sizes = capture_batch_sizes(max_bs)
    assert sizes[0] == 1 and sizes[-1] == max_bs
    assert all(a < b for a, b in pairwise(sizes))
    for bs in range(1, max_bs + 1):
        padded = sizes[bisect.bisect_left(sizes, bs)]
        assert bs <= padded and padded - bs < BATCH_SIZE_STEP


def test_small_batches_are_captured_exactly():
    assert capture_batch_sizes(160)[:5] == [1, 2, 4, 8, 16]
    assert len(capture_batch_sizes(160)) == 3 + 160 // BATCH_SIZE_STEP


def test_no_graphs_on_the_cpu(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, max_total_tokens=256, max_running_requests=4, cuda_graph_max_bs=4)
    assert runner.cuda_graph is None


def test_cuda_graph_flags():
    assert ServerArgs().cuda_graph_max_bs == 160 and not ServerArgs().disable_cuda_graph
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        ServerArgs(cuda_graph_max_bs=0).check()
