"""Random-weight Hugging Face Llama directories of real shapes, in bf16 safetensors: what measures a
directory's start under `--quantization w8a8_int8` (int8_layerwise.py: calibrated one layer at a time) at a
real model's size without downloading one.

The shapes are make_random_gguf.py's presets (TinyLlama-1.1B's, Llama-2-7B's, ...) and the tokenizer is the
embedded SmolLM2's, built from its GGUF (so the vocabulary is 49,152 tokens, as in the GGUF ladder's files).
Weights are transformers' initialisation (normal, std 0.02), made directly in bf16: the generator holds one
bf16 copy of the model (2.2 GB for TinyLlama's shape).

    python scripts/make_random_hf.py /tmp/tinyllama-bf16 --preset tinyllama-1.1b
    SRT_CACHE_DIR=$(mktemp -d) python -m srt.launch_server --model-path /tmp/tinyllama-bf16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_random_gguf import PRESETS  # noqa: E402  (a sibling script module: the shapes, defined once)
from srt.gguf_metadata import gguf_tokenizer  # noqa: E402
from srt.model_source import default_gguf_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the directory to write (created)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tinyllama-1.1b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layers", type=int, default=None, help="fewer decoder layers than the preset's (same widths)"
    )
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = PRESETS[args.preset]
    tokenizer = gguf_tokenizer(default_gguf_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=args.layers or shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.norm_eps,
        tie_word_embeddings=shape.tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )
    start = time.monotonic()
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: never an fp32 copy of the model
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    size = sum(
        os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out) if n.endswith(".safetensors")
    )
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.out}: {args.preset}, {params / 1e9:.2f} B parameters, {size / 1e9:.2f} GB of bf16 safetensors "
        f"in {time.monotonic() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
