"""A scheduler rank's model runner, from the server's flags: one place that maps `ServerArgs` onto
`ModelRunner`, for rank 0 (`scheduler_process.py`) and its tensor-parallel peers (`tp_peers.py`) alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.server_args import ServerArgs

if TYPE_CHECKING:
    from srt.model_executor.model_runner import ModelRunner


def build_runner(
    server_args: ServerArgs,
    model_dir: str,
    tp_rank: int = 0,
    dist_init_method: str | None = None,
    dp_rank: int = 0,
) -> ModelRunner:
    """This rank's model runner; every TP rank builds it from the same arguments."""
    from srt.model_executor.model_runner import ModelRunner

    return ModelRunner(
        model_dir,
        dtype=server_args.dtype,
        device=server_args.device,
        max_total_tokens=server_args.max_total_tokens,
        mem_fraction_static=server_args.mem_fraction_static,
        max_running_requests=server_args.max_running_requests,
        context_length=server_args.context_length,
        attention_backend=server_args.attention_backend,
        random_seed=server_args.random_seed,
        tp_rank=tp_rank,
        tp_size=server_args.tp_size,
        dist_init_method=dist_init_method,
        quantization=server_args.quantization,
        kv_cache_dtype=server_args.kv_cache_dtype,
        cuda_graph_max_bs=0 if server_args.disable_cuda_graph else server_args.cuda_graph_max_bs,
        dp_rank=dp_rank,
    )
