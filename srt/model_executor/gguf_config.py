"""A GGUF file's metadata as srt reads it: the transformers config of its family (what `config.json` would
say, field for field what transformers' own GGUF loader writes) and its EOS ids, from the validated header
alone (`gguf_file.GGUFFile`), before and without any weight (`gguf_loader` builds the model on them).

What a GGUF does not state is inferred as llama.cpp does: Gemma 3's sliding-window RoPE base and its score
scale (the 27B's from its layer count), the head size from the rotary dimensions, and the vocabulary from
the embedding's rows (a token list that disagrees is refused). A `rope_freqs` tensor, how llama.cpp's
converter stores Llama 3.1's scaling, becomes the config's per-frequency divisors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType

from srt.gguf_metadata import GGUF_ARCHITECTURES, gguf_chat_conventions
from srt.model_executor.gguf_file import GGUFError, GGUFFile
from srt.model_executor.layers.rotary_embedding import ROPE_FREQ_FACTORS
from srt.model_executor.unsupported import UnsupportedModelError

# the tensors the config reads: the embedding (the vocabulary), the head (absent: tied), the RoPE divisors
EMBEDDING, HEAD = "token_embd.weight", "output.weight"
# one divisor per rotary frequency (llama.cpp's converter writes Llama 3.1's scaling so)
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class Family:
    """What a GGUF architecture is in srt: the transformers config class it reads as (its `architectures`
    name: gguf_metadata.GGUF_ARCHITECTURES), its norm tensors' modules in a decoder layer, and whether its
    norms are stored as 1 + w."""

    config_class: str
    norms: dict[str, str]
    norm_plus_one: bool = False


_LLAMA_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
FAMILIES = {
    "llama": Family("LlamaConfig", _LLAMA_NORMS),
    "qwen2": Family("Qwen2Config", _LLAMA_NORMS),
    "qwen3": Family("Qwen3Config", _LLAMA_NORMS),
    "gemma3": Family(
        "Gemma3TextConfig",
        {
            "attn_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
        },
        norm_plus_one=True,
    ),
}
# GGUF's `{arch}.*` keys -> config fields, taken as they are where the file has them
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
}
TOKEN_IDS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "padding_token_id": "pad_token_id",
    "unknown_token_id": "unk_token_id",
}
# GGUF's rope.scaling.type -> transformers' rope_type (llama.cpp's "none" is the default rotation)
ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}
# Gemma 3's sliding-window layers keep their own base (transformers' default; GGUF files do not state it)
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# Gemma 3 27B's layers: the one size whose score scale is not its head size (168 = 5376 / 32, head 128)
GEMMA3_27B_LAYERS = 62


def gguf_family(metadata: dict) -> tuple[str, Family]:
    arch = metadata.get("general.architecture")
    if arch not in FAMILIES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; srt serves {', '.join(FAMILIES)}"
        )
    return arch, FAMILIES[arch]


def gguf_config(gguf: GGUFFile):
    """The transformers config the file's metadata describes, field for field what transformers' own GGUF
    loader writes to `config.json` for these families (the tests compare the two)."""
    import transformers

    meta = gguf.metadata
    arch, family = gguf_family(meta)

    def key(name: str):
        return meta.get(f"{arch}.{name}")

    fields = {field: key(k) for k, field in CONFIG_KEYS.items() if key(k) is not None}
    fields.update(
        {
            field: meta[f"tokenizer.ggml.{k}"]
            for k, field in TOKEN_IDS.items()
            if f"tokenizer.ggml.{k}" in meta
        }
    )
    fields["vocab_size"] = _vocab_size(gguf)
    fields["tie_word_embeddings"] = HEAD not in gguf.tensors
    fields["architectures"] = [GGUF_ARCHITECTURES[arch][1]]
    rope = _rope_parameters(key)
    if arch == "gemma3":
        fields["query_pre_attn_scalar"] = _gemma3_query_scalar(fields)
        local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}
        fields["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    else:
        dims = key("rope.dimension_count")
        heads = fields.get("num_attention_heads")
        if "head_dim" not in fields and dims is not None:
            fields["head_dim"] = dims
        if dims is not None and heads and dims != fields["head_dim"]:
            raise UnsupportedModelError(f"partial rotary embedding ({dims} of {fields['head_dim']} dims)")
        fields["rope_parameters"] = rope
    config = getattr(transformers, family.config_class)(**fields)
    if ROPE_FREQS in gguf.tensors:
        setattr(config, ROPE_FREQ_FACTORS, _rope_freq_factors(gguf, config))
    return config


def _rope_freq_factors(gguf: GGUFFile, config) -> list[float]:
    """The file's `rope_freqs` (F32, one finite positive divisor per frequency of a head): a list, so that
    the config stays plain data."""
    half = (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) // 2
    t = gguf.tensors[ROPE_FREQS]
    if t.ggml_type != GGMLQuantizationType.F32 or t.shape != (half,):
        raise GGUFError(f"tensor {ROPE_FREQS} is a {t.type_name} {t.shape}, not F32 ({half},)")
    factors = gguf.raw(ROPE_FREQS).view(torch.float32)
    if not bool(torch.isfinite(factors).all()) or not bool((factors > 0).all()):
        raise GGUFError(f"tensor {ROPE_FREQS} holds a factor that is not finite and positive")
    return factors.tolist()


def _gemma3_query_scalar(fields: dict) -> int:
    """Gemma 3 scales its scores by query_pre_attn_scalar^-0.5, which a GGUF does not state: the head size,
    except for the 27B (its layer count tells it, as llama.cpp does), which uses hidden size / heads."""
    head_dim = fields.get("head_dim", 256)
    if fields.get("num_hidden_layers") == GEMMA3_27B_LAYERS:
        return fields["hidden_size"] // fields["num_attention_heads"]
    return head_dim


def _rope_parameters(key: Callable[[str], object]) -> dict:
    params = {"rope_type": "default", "rope_theta": float(key("rope.freq_base") or 10000.0)}
    kind = key("rope.scaling.type")
    if kind is None or key("rope.scaling.factor") in (None, 1.0):
        return params
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    params.update(rope_type=ROPE_TYPES[kind], factor=float(key("rope.scaling.factor")))
    original = key("rope.scaling.original_context_length")
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    return params


def _vocab_size(gguf: GGUFFile) -> int:
    """The embedding's rows, which the token list must match (a file that disagrees is refused: ids past
    the table would index outside it)."""
    if EMBEDDING not in gguf.tensors or len(gguf.tensors[EMBEDDING].shape) != 2:
        raise GGUFError(f"the file has no 2-D {EMBEDDING}")
    rows = gguf.tensors[EMBEDDING].shape[0]
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != rows:
        raise GGUFError(f"the vocabulary has {len(tokens)} tokens but {EMBEDDING} has {rows} rows")
    return rows


def eos_token_ids(gguf: GGUFFile) -> list[int]:
    """The file's EOS id, then the family's end-of-turn token (Gemma's <end_of_turn>) where the vocabulary
    has it: a chat answer ends at either."""
    meta = gguf.metadata
    ids = [int(meta["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in meta else []
    _, end_of_turn = gguf_chat_conventions(meta)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if end_of_turn is not None and end_of_turn in tokens:
        token_id = tokens.index(end_of_turn)
        ids += [token_id] if token_id not in ids else []
    return ids
