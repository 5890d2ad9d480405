"""Random LoRA adapters in PEFT's format, made by PEFT itself, for the benchmarks and the quality gate (and the
tests): with B != 0 an adapter visibly changes the model, so what adapters cost and how the int8 base treats
them can be measured without a trained adapter (none may be downloaded)."""

from __future__ import annotations

from pathlib import Path

from srt.lora.config import LORA_TARGET_MODULES


def random_peft_adapter(
    model_dir: str,
    out: str | Path,
    rank: int,
    seed: int,
    std: float,
    alpha: float | None = None,
    use_rslora: bool = False,
    targets: tuple[str, ...] = LORA_TARGET_MODULES,
) -> str:
    """An adapter of `rank` on `targets` of every layer of `model_dir`, saved by PEFT into `out`; its A and B
    are drawn from N(0, std^2) with `seed`. `alpha` defaults to 2 x rank."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets),
        use_rslora=use_rslora,
        lora_dropout=0.1,  # a training-time setting: inference ignores it
        init_lora_weights=False,
    )
    peft = get_peft_model(model.eval(), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft.save_pretrained(out)
    return str(out)
