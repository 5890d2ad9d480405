"""One-time conversion of a GGUF file into a Hugging Face directory (fp32 safetensors + tokenizer).

Run as `python -m srt.model_executor.gguf_convert SRC DST`. transformers dequantizes the GGUF (it needs
`accelerate` for that); the result is written to a temporary sibling of DST and renamed into place, so a
reader never sees a half-written directory. The caller (`srt.model_source`) holds the file lock.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time

from srt.model_source import CONVERTED_MARKER

logger = logging.getLogger(__name__)

# GGUF files do not record the HF architecture name; every GGUF we serve goes through the Llama family.
FALLBACK_ARCHITECTURE = "LlamaForCausalLM"
DIR_MODE = 0o755
FILE_MODE = 0o644


def convert(src: str, dst: str) -> float:
    """Convert `src` (.gguf) into directory `dst`; returns the seconds it took."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    start = time.monotonic()
    gguf_dir, gguf_name = os.path.split(os.path.abspath(src))
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if not model.config.architectures:
        model.config.architectures = [FALLBACK_ARCHITECTURE]

    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            GenerationConfig.from_pretrained(gguf_dir, gguf_file=gguf_name).save_pretrained(tmp)
        except (OSError, ValueError):
            logger.info("no generation config in %s", src)
        seconds = time.monotonic() - start
        with open(os.path.join(tmp, CONVERTED_MARKER), "w") as f:
            json.dump({"source": os.path.abspath(src), "seconds": round(seconds, 2)}, f)
        _make_readable(tmp)
        if os.path.exists(dst):  # a stale, unmarked directory from an interrupted older run
            shutil.rmtree(dst)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return seconds


def _make_readable(directory: str) -> None:
    """mkdtemp and the safetensors writer create owner-only files; the cache is meant to be shared."""
    os.chmod(directory, DIR_MODE)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), FILE_MODE)


def main() -> None:
    parser = argparse.ArgumentParser(description="Convert a GGUF file to an fp32 safetensors HF directory.")
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[gguf_convert] %(message)s")
    seconds = convert(args.src, args.dst)
    logger.info("converted %s -> %s in %.1f s", args.src, args.dst, seconds)


if __name__ == "__main__":
    main()
