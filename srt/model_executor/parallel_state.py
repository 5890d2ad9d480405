"""The tensor-parallel group of one model replica: who this rank is, and the few collectives TP needs.

`torch.distributed` keeps its default process group in process-global state (its collectives, including
`broadcast_object_list`, find the group there). `TensorParallelGroup` is the one place that creates and
destroys that group; everything else reaches rank, size and collectives through the instance the
`ModelRunner` holds, so no code asks a global who it is. One TP group per process: a process is one rank
of one replica. At `size == 1` no process group exists and every collective is a no-op.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from srt.engine_options import DIST_TIMEOUT_SECONDS
from srt.model_executor.rendezvous import join_tcp_store

logger = logging.getLogger(__name__)

# Rank that owns the sockets and whose messages every rank replays.
SOURCE_RANK = 0
# Gloo's errors start with the source location ("[.../gloo/transport/tcp/pair.cc:537] Read error ...").
GLOO_ERROR = re.compile(r"^\[[^\]]*gloo/[^\]]*\]\s*")


def collective_failure(exc: BaseException) -> str | None:
    """The reason in one sentence when `exc` is a collective that failed because another rank closed its
    sockets or stopped answering (gloo, or a backend error such as NCCL's); None for any other error."""
    text = " ".join(str(exc).split())
    if isinstance(exc, dist.DistError) or GLOO_ERROR.match(text):
        reason = GLOO_ERROR.sub("", text)
        return reason.split(". ")[0][:300]
    return None


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    # The group carrying pickled Python objects: gloo even when tensors go over NCCL (objects live on the CPU).
    object_group: object | None = None

    @classmethod
    def create(
        cls,
        rank: int,
        size: int,
        init_method: str | None,
        device: str,
        timeout_seconds: float = DIST_TIMEOUT_SECONDS,
        ranks_per_node: int | None = None,
    ) -> TensorParallelGroup:
        """Join the group of `size` ranks at `init_method` (`file://PATH` on one machine, `tcp://HOST:PORT`
        across machines, each hosting `ranks_per_node` consecutive ranks); blocks until every rank has
        joined, at most `timeout_seconds`, which also bounds every collective. Gloo on CPU, NCCL on CUDA."""
        if size == 1:
            return cls()
        if not 0 <= rank < size:
            raise ValueError(f"tp rank {rank} is outside 0..{size - 1}")
        if init_method is None:
            raise ValueError(
                "tensor parallelism needs an init method (file:// or tcp://) shared by the ranks"
            )
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a process group; one TP rank per process")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        timeout = timedelta(seconds=timeout_seconds)
        if init_method.startswith("tcp://"):
            store = join_tcp_store(init_method, rank, size, ranks_per_node or size, timeout_seconds)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        else:
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
            )
        object_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        logger.info("joined the %s tensor-parallel group as rank %d of %d", backend, rank, size)
        return cls(rank, size, object_group)

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce `tensor` over the ranks, in place; every rank ends with the same bytes."""
        if self.size > 1:
            dist.all_reduce(tensor, op=op)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in rank order."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def min_across_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. a capacity all ranks must agree on)."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.int64)  # a CPU tensor: reduced over the (gloo) object group
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.object_group)
        return int(box.item())

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (the others' argument is ignored)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == SOURCE_RANK else None]
        dist.broadcast_object_list(box, src=SOURCE_RANK, group=self.object_group)
        return box[0]
