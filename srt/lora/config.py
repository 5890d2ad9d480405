"""The modules an adapter may target, the backends and the pool's defaults: torch-free, for the flags and the
HTTP process. The pool's own configuration (`LoRAConfig`) sits beside the pool it builds, in `manager.py`."""

from __future__ import annotations

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
