"""Loading a tokenizer without torch, for the processes that only tokenize and detokenize: from a Hugging
Face directory, or from a GGUF file's own tokenizer metadata (no converted directory, nothing cached)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from srt.model_source import is_gguf_file

logger = logging.getLogger(__name__)

ADVISORY_WARNINGS_ENV = "TRANSFORMERS_NO_ADVISORY_WARNINGS"

# Gemma 3's chat template, as google/gemma-3-270m's tokenizer_config.json has it (image parts included):
# its GGUF carries none (llama.cpp keeps Gemma's turn format in code), so a chat request would be refused.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
# What a GGUF of these model types (the HF config's model_type) lacks for chat: the template, used when the
# file has none, and the token that ends a model turn, an end token besides EOS (Gemma's generation_config
# lists both; its GGUF names only <eos>, so a chat answer would run on past its turn).
CHAT_TEMPLATES = {"gemma3_text": GEMMA3_CHAT_TEMPLATE}
END_OF_TURN_TOKENS = {"gemma3_text": "<end_of_turn>"}
# GGUF's `general.architecture` -> the HF config's model_type, where they differ
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}
# GGUF tokenizer keys -> the tokenizer's settings (transformers' names); the token ids become token strings
GGUF_TOKENIZER_KEYS = {
    "tokenizer.chat_template": "chat_template",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
}
GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def load_tokenizer(path: str):
    """The tokenizer of a Hugging Face directory (`AutoTokenizer.from_pretrained`) or of a `.gguf` file
    (built from its metadata), keeping torch out of a process that has not loaded it yet.

    Why: transformers imports torch whenever it is installed, and torch's libraries then stay resident
    (about 240 MB) in processes that only tokenize and detokenize (the HTTP process, the detokenizer).
    Without torch, transformers still loads tokenizers ("only tokenizers, configuration and file/data
    utilities"). The block is lifted afterwards, so a later `import torch` (an optional grammar backend's)
    still works."""
    with _without_torch():
        if is_gguf_file(path):
            return gguf_tokenizer(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def _without_torch() -> Iterator[None]:
    hide = "torch" not in sys.modules
    # transformers' first import would warn that PyTorch was not found: true here, and meant
    quiet = hide and "transformers" not in sys.modules and ADVISORY_WARNINGS_ENV not in os.environ
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # the import system's "not importable"
    if quiet:
        os.environ[ADVISORY_WARNINGS_ENV] = "1"
    try:
        yield
    finally:
        if hide and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
        if quiet:
            del os.environ[ADVISORY_WARNINGS_ENV]


def gguf_tokenizer(path: str):
    """The fast tokenizer a GGUF's metadata describes, as transformers builds it for `gguf_file=` (its
    builders, `convert_gguf_tokenizer`), read with srt's validating parser instead of transformers' reader
    (which imports torch), plus the family's chat conventions (`gguf_chat_conventions`). About half a
    second for SmolLM2's 49k tokens; nothing is written anywhere."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    from srt.model_executor.gguf_file import GGUFFile

    meta = GGUFFile.open(path).metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens: no tokenizer to build")
    fields = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    settings = {name: meta[key] for key, name in GGUF_TOKENIZER_KEYS.items() if key in meta}
    if fields.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary by default
        settings.setdefault("add_bos_token", True)
    for name, key in GGUF_SPECIAL_TOKENS.items():
        token_id = meta.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            settings[name] = tokens[token_id]
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], fields)
    template, _ = gguf_chat_conventions(meta)
    if template is not None and "chat_template" not in settings:
        settings["chat_template"] = template
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings)


def gguf_chat_conventions(metadata: dict) -> tuple[str | None, str | None]:
    """(chat template, end-of-turn token) a GGUF of this architecture lacks and srt adds: the template only
    where the file has none."""
    arch = metadata.get("general.architecture")
    model_type = GGUF_MODEL_TYPES.get(arch, arch)
    template = None if "tokenizer.chat_template" in metadata else CHAT_TEMPLATES.get(model_type)
    return template, END_OF_TURN_TOKENS.get(model_type)
