"""Random-weight LoRA adapters made by PEFT itself, and PEFT's logits as the reference the LoRA tests compare
srt with."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from srt.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from srt.lora.config import LORA_TARGET_MODULES
from srt_bench.lora_adapters import random_peft_adapter

# Standard deviation of the random A and B: an adapter's delta then moves the tiny model's projections by about
# as much as their base outputs, so a missing, misplaced or mis-scaled delta is far outside any tolerance.
LORA_WEIGHT_STD = 0.08


def base_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    # eager attention: the one transformers implements soft-capping and sliding windows in for every family
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def save_peft_adapter(
    model_dir: str,
    out: Path,
    rank: int,
    seed: int,
    alpha: float | None = None,
    use_rslora: bool = False,
    targets: tuple[str, ...] = LORA_TARGET_MODULES,
    std: float = LORA_WEIGHT_STD,
) -> str:
    """An adapter of `rank` on `targets` of every layer, saved by PEFT; its A and B are random (B != 0)."""
    return random_peft_adapter(model_dir, out, rank, seed, std, alpha, use_rslora, targets)


@torch.no_grad()
def peft_logits(model_dir: str, adapter_dir: str | None, ids: list[int]) -> torch.Tensor:
    """transformers' (+ PEFT's, with an adapter) fp32 logits at every position of `ids`."""
    from peft import PeftModel

    model = base_model(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return model(torch.tensor([ids])).logits[0].float()


def write_adapter(out: Path, shapes: dict[str, tuple[int, int]], rank: int = 4, **config) -> Path:
    """A valid adapter of `rank` on every module of `shapes` (path -> (in, out)), as PEFT saves one; `config`
    overrides adapter_config.json's fields."""
    out.mkdir(parents=True, exist_ok=True)
    fields = dict(
        peft_type="LORA", r=rank, lora_alpha=2 * rank, lora_dropout=0.1, bias="none", use_dora=False,
        target_modules=sorted({p.rsplit(".", 1)[-1] for p in shapes}), modules_to_save=None, use_rslora=False,
    )  # fmt: skip
    (out / CONFIG_FILE).write_text(json.dumps({**fields, **config}))
    tensors = {}
    for path, (fan_in, fan_out) in shapes.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = torch.randn(rank, fan_in)
        tensors[f"base_model.model.{path}.lora_B.weight"] = torch.randn(fan_out, rank)
    save_file(tensors, str(out / WEIGHTS_FILE))
    return out
