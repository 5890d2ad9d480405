"""What a GGUF file's metadata says that the torch-free processes need: its tokenizer (the HTTP process,
the detokenizer, the grammar backend), the chat conventions srt adds where the file lacks them, and its
model card for `/model_info`. Read with srt's validating parser (`model_executor/gguf_file.py`, which imports
torch only to map tensors: never here)."""

from __future__ import annotations

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
# GGUF's `general.architecture` -> (the HF config's model_type, its `architectures` name): the families srt
# serves from a GGUF's blocks (gguf_config.FAMILIES builds each)
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
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


def check_gguf(path: str) -> None:
    """Parse and validate a GGUF's header and tensor table (GGUFError naming the problem): a launcher's check
    before it starts any child, so a broken or crafted file fails in about a second, not after the children
    have started (0.1-0.25 s for the embedded files' vocabularies)."""
    from srt.model_executor.gguf_file import GGUFFile

    GGUFFile.open(path)


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
    model_type = GGUF_ARCHITECTURES.get(arch, (arch, None))[0]
    template = None if "tokenizer.chat_template" in metadata else CHAT_TEMPLATES.get(model_type)
    return template, END_OF_TURN_TOKENS.get(model_type)


def gguf_model_card(path: str) -> dict:
    """What a model directory's config.json would tell `/model_info` (model_type, architectures), from a
    GGUF's metadata; {} for an architecture srt does not serve."""
    from srt.model_executor.gguf_file import GGUFFile

    arch = GGUFFile.open(path).metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        return {}
    model_type, architecture = GGUF_ARCHITECTURES[arch]
    return {"model_type": model_type, "architectures": [architecture]}
