"""Which decode batch sizes get a CUDA graph (the replay itself is tested on a GPU: test_cuda_model.py), and
that nothing is captured where graphs cannot run."""

from __future__ import annotations

import bisect
import dataclasses
from itertools import pairwise

import pytest

from srt.model_executor.cuda_graph_runner import BATCH_SIZE_STEP, capture_batch_sizes
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from srt.server_args_cli import CLI_TYPES


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


def test_cuda_graph_and_memory_flags_parse_to_numbers():
    assert ServerArgs().cuda_graph_max_bs == 160 and not ServerArgs().disable_cuda_graph
    assert ServerArgs().mem_fraction_static is None  # resolved per device by the model runner
    args = ServerArgs.parse(
        ["--cuda-graph-max-bs", "8", "--mem-fraction-static", "0.5", "--disable-cuda-graph"]
    )
    assert args.cuda_graph_max_bs == 8 and args.mem_fraction_static == 0.5 and args.disable_cuda_graph
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        ServerArgs(cuda_graph_max_bs=0).check()
    with pytest.raises(SystemExit):
        ServerArgs.parse(["--mem-fraction-static", "1.5"])


def test_every_flag_parses_to_its_fields_type():
    """argparse converts each flag to the type of its field (an unknown annotation fails here first)."""
    for f in dataclasses.fields(ServerArgs):
        assert f.type == "bool" or str(f.type) in CLI_TYPES, f.name
