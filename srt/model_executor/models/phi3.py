"""Phi-3 (`Phi3ForCausalLM`): Llama's decoder under another name, with its checkpoint's tensors already fused.

transformers' Phi-3 is Mistral's layer (pre-norm RMSNorm, SiLU-gated MLP, rotate-half RoPE, a sliding window
on every layer when the config sets one) with q/k/v stored as one `qkv_proj` and gate/up as one
`gate_up_proj`, in that order: the loader splits them into the shards srt's fused layers already have
(so tensor parallelism slices each shard per rank). Its LongRoPE scaling is read in `rotary_embedding.py`,
and a `partial_rotary_factor` below 1 (Phi-4-mini) is refused there.
"""

from __future__ import annotations

from srt.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # architecture name -> (qkv_bias, qk_norm)
    ARCH_SWITCHES = {"Phi3ForCausalLM": (False, False)}
    # checkpoint module -> its shards, in the order the checkpoint stacks them along the output features
    FUSED_CHECKPOINT_PARAMS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
