"""One-time conversion of a GGUF file into a Hugging Face directory (fp32 safetensors + tokenizer).

Run as `python -m srt.model_executor.gguf_convert SRC DST`. transformers dequantizes the GGUF (it needs
`accelerate` for that); the result is written to a temporary sibling of DST and renamed into place, so a
reader never sees a half-written directory. The caller (`srt.model_source`) holds the file lock.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
import time

from srt.gguf_metadata import CHAT_TEMPLATES, END_OF_TURN_TOKENS
from srt.model_source import CONVERTED_MARKER

logger = logging.getLogger(__name__)

# GGUF files do not record the HF architecture name; transformers names it for the families whose GGUF it
# maps to a model class of their own (Gemma 3: Gemma3ForCausalLM), and the rest are Llama-family.
FALLBACK_ARCHITECTURE = "LlamaForCausalLM"
DIR_MODE = 0o755
FILE_MODE = 0o644


@contextlib.contextmanager
def parsed_once():
    """While converting, one `gguf.GGUFReader` per file and one tensor-name map per (architecture, layers).

    transformers parses the whole file anew for the tokenizer, the config, the weights and the generation
    config (~4 s each for SmolLM2's 49k-entry vocabulary), and rebuilds gguf's tensor-name map for every
    module it maps (~400 times, ~6 s): about 19 of a first start's 26 s. It imports both from `gguf` where it
    calls them, so sharing them here is seen there; the readers are read-only memory maps."""
    import gguf

    make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(make_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_map


def convert(src: str, dst: str) -> float:
    """Convert `src` (.gguf) into directory `dst`; returns the seconds it took."""
    start = time.monotonic()
    with parsed_once():
        return _convert(src, dst, start)


def _convert(src: str, dst: str, start: float) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

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
    try:
        generation_config = GenerationConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
    except (OSError, ValueError):
        logger.info("no generation config in %s; using the model's", src)
        generation_config = model.generation_config
    add_chat_conventions(model.config.model_type, tokenizer, generation_config)

    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
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


def add_chat_conventions(model_type: str, tokenizer, generation_config) -> None:
    """Give the tokenizer its family's chat template when the GGUF had none, and add the family's end-of-turn
    token to the generation config's EOS ids (the runner stops at every one of them)."""
    template = CHAT_TEMPLATES.get(model_type)
    if template is not None and not getattr(tokenizer, "chat_template", None):
        logger.info("no chat template in the GGUF: using %s's", model_type)
        tokenizer.chat_template = template
    end_of_turn = END_OF_TURN_TOKENS.get(model_type)
    if end_of_turn is None:
        return
    token_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    if token_id is None or token_id == tokenizer.unk_token_id:
        logger.warning("%s has no %s token; chat answers end at EOS only", model_type, end_of_turn)
        return
    eos = generation_config.eos_token_id
    ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    generation_config.eos_token_id = ids + ([token_id] if token_id not in ids else [])


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
