"""What a runner serving LoRA adapters is built with, and the modules an adapter may target."""

from __future__ import annotations

from dataclasses import dataclass

# The checkpoint modules of a Llama-shaped decoder layer that an adapter may adapt (PEFT's names). The model's
# fused layers stack some of them (qkv_proj: q, k, v; gate_up_proj: gate, up), each keeping its own A and B.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# --lora-backend's choices: segment matmuls in PyTorch grouped by adapter (SGLang's name for its pure-PyTorch
# backend; on the int8 CPU base, srt's C kernel), or srt's Triton shrink / expand kernels (srt/lora/triton_lora.py)
LORA_BACKENDS = ("torch_native", "triton")

# SGLang's default for --max-loras-per-batch: adapter slots in the weight pool, so distinct adapters per step.
DEFAULT_MAX_LORAS_PER_BATCH = 8
# The pool pads every adapter to this rank unless told otherwise. Padding costs memory only (each step
# multiplies at its adapters' own ranks): rank 16 in 8 slots is 149 MiB of fp32 for SmolLM2-135M (30 layers,
# all seven modules), growing linearly with both.
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras_per_batch`: pool slots, the most distinct adapters one step serves. `max_loaded_loras`: the
    most adapters held in host memory at once (None: no limit); loading one more is refused rather than
    silently dropping one a client may still name. `max_lora_rank`: the largest rank the pool takes.
    `target_modules`: the modules adapters may adapt (a subset of LORA_TARGET_MODULES). `backend`: one of
    LORA_BACKENDS."""

    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    max_loaded_loras: int | None = None
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    backend: str = LORA_BACKENDS[0]

    def __post_init__(self):
        unknown = sorted(set(self.target_modules) - set(LORA_TARGET_MODULES))
        if unknown:
            raise ValueError(f"LoRA target modules {unknown} are not among {list(LORA_TARGET_MODULES)}")
        if self.max_loras_per_batch < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras_per_batch and max_lora_rank must be at least 1")
        if self.backend not in LORA_BACKENDS:
            raise ValueError(f"LoRA backend {self.backend!r} is not among {list(LORA_BACKENDS)}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < 1:
            raise ValueError("max_loaded_loras must be at least 1 (or None: no limit)")
