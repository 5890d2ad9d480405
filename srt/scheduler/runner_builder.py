"""A scheduler rank's model runner, from the server's flags: one place that maps `ServerArgs` onto a
`RunnerConfig`, for rank 0 (`scheduler_process.py`) and its tensor-parallel peers (`tp_peers.py`) alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from srt.lora.adapter import adapter_rank
from srt.lora.config import DEFAULT_MAX_LORA_RANK
from srt.lora.manager import LoRAConfig
from srt.lora.specs import lora_enabled, slots_per_batch, startup_adapters, target_modules
from srt.model_executor.runner_config import RunnerConfig
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
    """This rank's model runner, with its start-up LoRA adapters loaded; every TP rank builds it from the
    same arguments."""
    from srt.model_executor.model_runner import ModelRunner

    runner = ModelRunner(runner_config(server_args, model_dir, tp_rank, dist_init_method, dp_rank))
    for spec in startup_adapters(server_args.lora_paths, server_args.lora_modules):
        runner.lora.load(spec.name, spec.path, spec.pinned)  # AdapterError: one line, exit 2
    return runner


def runner_config(
    server_args: ServerArgs,
    model_dir: str,
    tp_rank: int = 0,
    dist_init_method: str | None = None,
    dp_rank: int = 0,
) -> RunnerConfig:
    """The one mapping of the flags onto a runner's inputs; the rank's place (`tp_rank`, `dp_rank`, where the
    ranks meet) comes from its launcher."""
    return RunnerConfig(
        model_dir=model_dir,
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
        quantization=server_args.quantization_or_default,
        kv_cache_dtype=server_args.kv_cache_dtype,
        # an embedding server never decodes: no decode graphs to capture
        cuda_graph_max_bs=0
        if server_args.disable_cuda_graph or server_args.is_embedding
        else server_args.cuda_graph_max_bs,
        dp_rank=dp_rank,
        lora=lora_config(server_args),
        nnodes=server_args.nnodes,
        dist_timeout=server_args.dist_timeout,
    )


def lora_config(args: ServerArgs) -> LoRAConfig | None:
    """The runner's LoRA pool, from the flags (None: LoRA off). The slots' rank is --max-lora-rank, else the
    largest rank among the start-up adapters (and at least the default)."""
    if not lora_enabled(args):
        return None
    rank = args.max_lora_rank
    if rank is None:
        ranks = [adapter_rank(s.path) for s in startup_adapters(args.lora_paths, args.lora_modules)]
        rank = max([DEFAULT_MAX_LORA_RANK, *(r for r in ranks if r is not None)])
    return LoRAConfig(
        max_loras_per_batch=slots_per_batch(args),
        max_loaded_loras=args.max_loaded_loras,
        max_lora_rank=rank,
        target_modules=target_modules(args),
        backend=args.lora_backend,
    )
