"""What a ModelRunner is built with, settled from the flags, the model's config and the host before it
builds anything: the device, the dtypes, whether tensor parallelism can split this model, the memory the KV
pool may take and the EOS ids. Kept apart from the runner so a bad flag fails at start-up with one line,
before any weight loads, and so a launcher (`tp_peers.check_tp_size`) can ask without building a runner.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from srt.engine_options import DTYPE_NAMES, KV_CACHE_DTYPES
from srt.model_executor.layers import cpu_kernels
from srt.model_executor.layers.linear_method import CPU_KERNEL_QUANTIZATIONS

MEMINFO_PATH = "/proc/meminfo"
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def resolve_device(device: str, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0) -> str:
    """`auto` is CUDA when available. With several ranks on CUDA, each takes its own GPU: data-parallel
    replica r's tensor-parallel rank t uses GPU r * tp_size + t, as SGLang lays them out."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = "this torch has no CUDA support" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"--device {device}: {build}; use --device cpu (or auto)")
    if device == "cuda" and (tp_size > 1 or dp_rank > 0):
        index = dp_rank * tp_size + tp_rank
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"data-parallel replica {dp_rank}, tensor-parallel rank {tp_rank} needs GPU {index}, but "
                f"{torch.cuda.device_count()} GPUs are visible; lower --dp-size or --tp-size"
            )
        device = f"cuda:{index}"
        torch.cuda.set_device(device)
    return device


def check_tp_divides(hf_config, tp_size: int) -> None:
    """Fail before loading anything when the heads (or the MLP) cannot be split evenly over the ranks."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": hf_config.intermediate_size,
    }
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp_size != 0]
    if bad:
        raise ValueError(
            f"--tp-size {tp_size} does not divide this model's {', '.join(bad)}; "
            f"choose a tp size dividing {heads} attention heads and {kv_heads} KV heads"
        )


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto` is fp32 on CPU (fp32 matmuls are ~100x faster than bf16 on AVX2 CPUs), bf16 on GPU."""
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_kv_cache_dtype(
    requested: str, quantization: str, device: str, model_dtype: torch.dtype
) -> torch.dtype:
    """`--kv-cache-dtype`: auto is float16 where srt's CPU kernels attend (with the int8 and GGUF methods:
    they read half-precision K/V exactly; the cache then takes half the memory and a decode step reads half
    the bytes), else the model's dtype. An explicit choice other than the model's is CPU-only: the GPU
    backend attends in one dtype."""
    if requested == "auto":
        kernels = (
            quantization in CPU_KERNEL_QUANTIZATIONS and device == "cpu" and cpu_kernels.load() is not None
        )
        return torch.float16 if kernels else model_dtype
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {requested!r}; choose one of {KV_CACHE_DTYPES}")
    dtype = getattr(torch, requested)
    if dtype != model_dtype and device != "cpu":
        raise ValueError(f"--kv-cache-dtype {requested} differs from the model's {model_dtype}: CPU only")
    return dtype


def available_memory_bytes(device: str) -> int:
    """Free memory the KV pool may take a fraction of: device memory on GPU, MemAvailable on CPU."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open(MEMINFO_PATH) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"MemAvailable not found in {MEMINFO_PATH}")


def eos_token_ids_of(model_dir: str, hf_config) -> list[int]:
    """EOS ids from generation_config.json (which may list several) and config.json, in order, deduplicated."""
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    try:
        sources.insert(0, GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except OSError:
        pass
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return ids
