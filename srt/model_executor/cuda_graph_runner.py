"""Decode steps replayed from CUDA graphs: the kernel launches of a whole decode step, recorded once.

A small model's decode step on a GPU is a few hundred short kernels; launching them one by one from Python
costs more than running them. At start-up the runner records the decode step once per batch size of a ladder
(`capture_batch_sizes`) into graphs that read their inputs from static buffers. A decode batch of size `bs`
is copied into those buffers and the smallest recorded size >= bs is replayed; the padding rows decode a
dummy token into the reserved padding KV slot, and their logits are dropped.

What makes a replay equal an eager step: every input of the step is one of the static buffers, and the
attention backend's decode reads nothing from the host (`cuda_graph_safe_decode`), so the recorded launches
stay right when the batch's lengths and KV slots change. Extend and mixed steps always run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from srt.mem_cache.memory_pool import PADDING_SLOT
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

# Small batches each get a graph (they are where launch overhead dominates); above that every 8th size, so
# a batch pads by at most 7 rows.
SMALL_BATCH_SIZES = (1, 2, 4)
BATCH_SIZE_STEP = 8
# Eager runs before each capture: the first call may compile or autotune kernels and allocate workspaces,
# which must not happen inside the capture.
WARMUP_RUNS = 2


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes to record, ascending, ending exactly at `max_bs`."""
    sizes = [s for s in SMALL_BATCH_SIZES if s < max_bs]
    sizes += range(BATCH_SIZE_STEP, max_bs, BATCH_SIZE_STEP)
    return sorted(set(sizes)) + [max_bs]


class CudaGraphRunner:
    def __init__(self, forward_eager: Callable[[ForwardBatch], torch.Tensor], device: str, max_bs: int):
        """`forward_eager`: the model runner's own eager step (backend metadata, then the model), recorded
        as it is, so a replay is that step."""
        self.forward_eager = forward_eager
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = max_bs
        index = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, **index)
        self.positions = torch.zeros(max_bs, **index)
        self.out_cache_loc = torch.full((max_bs,), PADDING_SLOT, **index)
        self.req_pool_indices = torch.zeros(max_bs, **index)
        self.seq_lens = torch.ones(max_bs, **index)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        start = time.monotonic()
        pool = None
        # largest first: the smaller graphs then fit in the memory pool the largest one reserved
        for bs in reversed(self.batch_sizes):
            pool = self._capture(bs, pool)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.2f s",
            len(self.graphs),
            self.batch_sizes[0],
            max_bs,
            time.monotonic() - start,
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[],  # a graph-safe backend never reads it; the recorded step could not use it
        )

    @torch.inference_mode()
    def _capture(self, bs: int, pool):
        batch = self._static_batch(bs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.forward_eager(batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.logits[bs] = self.forward_eager(batch)
        self.graphs[bs] = graph
        return graph.pool()

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits [bs, vocab] of a decode batch; valid until the next replay (graph-owned memory)."""
        bs = batch.batch_size
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc)
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        if padded > bs:
            # a larger batch may have left real KV slots here: padding rows must only touch the padding slot
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.out_cache_loc[bs:padded].fill_(PADDING_SLOT)
            self.req_pool_indices[bs:padded].zero_()
            self.seq_lens[bs:padded].fill_(1)
        self.graphs[padded].replay()
        return self.logits[padded][:bs]
