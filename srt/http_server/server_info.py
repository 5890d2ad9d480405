"""What the server says about itself: `/v1/models`, `/server_info`, `/model_info` and `/tokenizer_info`.

Gateways read these to recognise and place a worker, so the names are SGLang's (and vLLM's for
`/tokenizer_info`). The Shepherd Model Gateway detects the engine from `/v1/models`' first `owned_by`
(`sglang` is recognised at once; any other value costs it fallback probes) and reads `/server_info` and
`/model_info` into worker labels; a field of the wrong type makes it drop the whole answer, so sizes are
integers and absent values are null, never strings. Sizes are the values in effect (the KV pool the
scheduler built, the context it serves), not the flags, whose defaults are null.
"""

from __future__ import annotations

import dataclasses
import json
import os

from srt.gguf_metadata import gguf_model_card
from srt.io_struct import SchedulerReady
from srt.model_source import is_gguf_file
from srt.server_args import ServerArgs

# The `owned_by` of srt's model card: the value gateways (SMG, sglang-router) read as an SGLang worker, whose
# routes and fields srt answers.
OWNED_BY = "sglang"
# tokenizer_config.json entries that are not JSON values a client could use (added tokens' objects are).
_TOKENIZER_CONFIG_SKIP = ("added_tokens_decoder",)


def model_card(model_name: str, created: int, context_len: int) -> dict:
    return {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": OWNED_BY,
        "root": model_name,
        "max_model_len": context_len,
    }


def adapter_card(adapter, base_name: str, created: int, context_len: int) -> dict:
    """A served LoRA adapter in /v1/models: vLLM's card, its `parent` the base model, its `root` its path."""
    return {**model_card(adapter.name, created, context_len), "root": adapter.path, "parent": base_name}


def model_config(model_dir: str) -> dict:
    """The model directory's config.json (a GGUF's metadata: its model card), or {} if it has none."""
    if is_gguf_file(model_dir):
        return gguf_model_card(model_dir)
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def model_info(args: ServerArgs, model_dir: str, context_len: int) -> dict:
    config = model_config(model_dir)
    return {
        "model_path": args.model_path or model_dir,
        "tokenizer_path": args.tokenizer_path or model_dir,
        "served_model_name": args.model_name,
        "is_generation": not args.is_embedding,
        "context_length": context_len,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }


def server_info(args: ServerArgs, ready: SchedulerReady | None, version: str) -> dict:
    """Every flag (the API key left out), the scheduler's limits, and SGLang's names for the sizes in effect."""
    info = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
    if ready is not None:
        info.update(dataclasses.asdict(ready))
        info["context_length"] = ready.context_len
        info["max_total_tokens"] = ready.max_total_num_tokens
    info["model_id"] = args.model_name
    info["served_model_name"] = args.model_name
    info["is_embedding"] = args.is_embedding
    info["version"] = version
    return info


def tokenizer_info(tokenizer, context_len: int) -> dict:
    """vLLM's `/tokenizer_info`: the tokenizer's configuration (its special tokens as text, its chat template)
    and `tokenizer_class`, as lm-evaluation-harness's remote tokenizer reads it."""
    info = {k: v for k, v in tokenizer.init_kwargs.items() if k not in _TOKENIZER_CONFIG_SKIP and _is_json(v)}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        info[name] = value if isinstance(value, str) else None
    info["chat_template"] = tokenizer.chat_template
    info["model_max_length"] = context_len
    info["tokenizer_class"] = type(tokenizer).__name__
    return info


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
