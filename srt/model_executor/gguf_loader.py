"""Builds srt's model straight from a GGUF file's quantized blocks: nothing converted, calibrated or cached.

The file is parsed and validated once (`gguf_file.GGUFFile`); its metadata becomes a transformers config of
the family (what `config.json` would say: `gguf_config`), the model is built on the meta device, and then:
- every linear layer gets the file's blocks through `GGUFLinearMethod.install` (views of a private, read-only
  map of the file: only the pages a kernel reads become resident, and they are the page cache's), the parts
  of a fused layer in shard order (q, k, v; gate, up), each in its own block type;
- the embedding table stays in its block format too (`BlockEmbedding`: rows dequantized on lookup), and a
  tied output head multiplies by the same blocks;
- only norms and biases (small fp32 vectors) are materialised and copied.
So no fp32 copy of a weight matrix ever exists. A tensor whose block type the kernels cannot run is refused
before anything is built, in one line naming the tensor and the type (a ValueError: exit 2 at start-up).

Two facts of llama.cpp's converter are undone here: it permutes the rows of Llama's q and k projections
for its rotary embedding (pairs (2i, 2i+1) rotate together instead of (i, i + d/2)), which a row index
permutation undoes (each row is quantized along its inputs only, so rows move whole; q and k are then
copied, their share of the file: 6 % of SmolLM2); and it stores Gemma's norm weights as 1 + w, which
srt's Gemma norm adds itself. Gemma 3 and Qwen files are not permuted.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType
from torch import nn

from srt.gguf_metadata import GGUF_ARCHITECTURES, gguf_chat_conventions
from srt.model_executor.gguf_file import GGUFError, GGUFFile
from srt.model_executor.gguf_int8 import BlockInstaller, gguf_method
from srt.model_executor.layers.block_embedding import BlockEmbedding
from srt.model_executor.layers.gguf_linear import SUPPORTED_TYPES, BlockMatrix
from srt.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from srt.model_executor.layers.linear_method import LayerMethods
from srt.model_executor.layers.rotary_embedding import ROPE_FREQ_FACTORS
from srt.model_executor.meta_build import on_meta_device
from srt.model_executor.models.registry import get_model_class
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.unsupported import UnsupportedModelError

logger = logging.getLogger(__name__)

EMBEDDING, HEAD, FINAL_NORM = "token_embd.weight", "output.weight", "output_norm.weight"
# one divisor per rotary frequency (llama.cpp's converter writes Llama 3.1's scaling so)
ROPE_FREQS = "rope_freqs.weight"
BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Llama-layer files whose q/k rows llama.cpp permuted for its rotary embedding
PERMUTED_QK_ARCHS = ("llama",)


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
# a decoder layer's linear tensors -> (its module in the layer, the shard of a fused one)
LINEAR_PARTS = {
    "attn_q": ("self_attn.qkv_proj", "q"),
    "attn_k": ("self_attn.qkv_proj", "k"),
    "attn_v": ("self_attn.qkv_proj", "v"),
    "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", "gate"),
    "ffn_up": ("mlp.gate_up_proj", "up"),
    "ffn_down": ("mlp.down_proj", None),
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


def unsupported_tensor(gguf: GGUFFile) -> str | None:
    """One line naming the first tensor whose block type srt's kernels cannot run (None: all can)."""
    for t in gguf.tensors.values():
        if t.ggml_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(GGMLQuantizationType(q).name for q in SUPPORTED_TYPES))
            return f"tensor {t.name} is stored as {t.type_name}, which srt cannot run (it runs {supported})"
    return None


class GGUFCheckpoint:
    """A GGUF file as the model runner reads a checkpoint: its config, EOS ids and a model built on its
    blocks (`model_loader.HFCheckpoint` is the same for a Hugging Face directory). `quantization`: `gguf`
    (the blocks themselves) or `gguf_int8` (int8 made from them); None: the measured rule's choice for
    this file (`gguf_int8.gguf_method`)."""

    def __init__(self, path: str, quantization: str | None = None):
        self.path = path
        self.file = GGUFFile.open(path)
        self.quantization = quantization or gguf_method(self.file)
        self.hf_config = gguf_config(self.file)
        self.eos_token_ids = eos_token_ids(self.file)
        # why its blocks cannot run here (None: they can), said before anything is built
        self.refusal = unsupported_tensor(self.file)

    def load_model(
        self,
        max_positions: int,
        dtype: torch.dtype,
        device: str,
        tp: TensorParallelGroup,
        methods: LayerMethods,
        skip=None,
    ) -> nn.Module:
        """The model on the file's blocks (`skip`, the int8 cache's hook, never applies: nothing here is
        replaced later)."""
        if methods.quantization != self.quantization:
            raise ValueError(
                f"this GGUF file runs with --quantization {self.quantization}, not {methods.quantization} "
                "(the dense methods read the converted checkpoint)"
            )
        if device != "cpu":
            raise ValueError(f"--quantization {self.quantization} runs on the CPU only; use --device cpu")
        if self.refusal is not None:
            raise GGUFError(self.refusal)
        return build_model(self.file, self.hf_config, max_positions, dtype, device, tp, methods)


def build_model(
    gguf: GGUFFile,
    hf_config,
    max_positions: int,
    dtype: torch.dtype,
    device: str,
    tp: TensorParallelGroup,
    methods: LayerMethods,
) -> nn.Module:
    arch_name, model_class = get_model_class(hf_config.architectures)
    arch, family = gguf_family(gguf.metadata)
    with on_meta_device(dtype):
        model = model_class(hf_config, arch_name, max_positions, dtype, device, tp, methods)
    embedding = _matrix(gguf, EMBEDDING)
    model.model.embed_tokens = BlockEmbedding(embedding)
    installer = BlockInstaller()
    _install_linear_layers(model, gguf, arch, hf_config, tp, embedding, installer.install)
    installer.log(gguf.path)
    model = model.to_empty(device=device)  # the norms and biases: every weight matrix is the file's
    _copy_vectors(model, gguf, family, arch in PERMUTED_QK_ARCHS, hf_config)
    model.eval().requires_grad_(False)
    logger.info("loaded %s from the blocks of %s (no conversion)", arch_name, gguf.path)
    return model


def _matrix(gguf: GGUFFile, name: str) -> BlockMatrix:
    t = gguf.tensors[name]
    if len(t.shape) != 2:
        raise GGUFError(f"tensor {name} has shape {t.shape}, not a 2-D weight")
    return BlockMatrix(t.ggml_type, t.shape[0], t.shape[1], gguf.raw(name))


def _install_linear_layers(
    model: nn.Module,
    gguf: GGUFFile,
    arch: str,
    config,
    tp: TensorParallelGroup,
    embedding: BlockMatrix,
    install: Callable[[nn.Module, list[BlockMatrix]], None],
) -> None:
    """Hand every linear layer its blocks (this rank's rows, or columns, of each part), then the head,
    through `install` (`gguf_int8.BlockInstaller.install`: the blocks, or int8 made from them)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    parts: dict[str, dict[str | None, BlockMatrix]] = {}
    for name in gguf.tensors:
        m = BLOCK_TENSOR.match(name)
        if m is None or m.group(3) != "weight" or m.group(2) not in LINEAR_PARTS:
            continue
        module, shard = LINEAR_PARTS[m.group(2)]
        matrix = _matrix(gguf, name)
        if arch in PERMUTED_QK_ARCHS and shard in ("q", "k"):
            matrix = matrix.select_rows(unpermute_index(matrix.rows, heads if shard == "q" else kv_heads))
        parts.setdefault(f"model.layers.{m.group(1)}.{module}", {})[shard] = matrix
    for name, layer in model.named_modules():
        if isinstance(layer, ColumnParallelLinear):
            got = parts.pop(name, {})
            missing = [s for s in layer.shard_offsets if s not in got]
            if missing:
                raise GGUFError(f"the file lacks the {'/'.join(missing)} part(s) of {name}")
            shards = [_rows(got[s], layer, s) for s in layer.shard_offsets]
            install(layer, shards)
        elif isinstance(layer, RowParallelLinear):
            got = parts.pop(name, {})
            if None not in got:
                raise GGUFError(f"the file has no weight for {name}")
            install(layer, [_columns(got[None], layer.tp.rank, layer.in_local)])
    if parts:
        raise GGUFError(f"tensors with no layer to go to: {sorted(parts)[:4]}")
    head = embedding if model.tie_word_embeddings else _matrix(gguf, HEAD)
    install(model.lm_head, [head])


def unpermute_index(rows: int, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: within each head it stores rows (i, i + d/2) at (2i, 2i + 1);
    row r of Hugging Face's order is row index[r] of the file's."""
    d = rows // heads
    return torch.arange(rows).view(heads, d // 2, 2).transpose(1, 2).reshape(-1)


def _rows(m: BlockMatrix, layer: ColumnParallelLinear, shard: str) -> BlockMatrix:
    """This rank's output rows of a column-parallel part (a view)."""
    size = layer.shard_offsets[shard][1]
    if m.rows != size * layer.tp.size:
        raise GGUFError(f"the {shard} part has {m.rows} rows, not the {size * layer.tp.size} the model has")
    return m.narrow(0, layer.tp.rank * size, size)


def _columns(m: BlockMatrix, rank: int, width: int) -> BlockMatrix:
    """This rank's input columns of a row-parallel weight: whole blocks of each row (a view; a split off
    the blocks' boundaries is a ValueError naming --tp-size's effect)."""
    if m.cols == width:
        return m
    try:
        return m.narrow(1, rank * width, width)
    except ValueError as e:
        raise ValueError(f"--tp-size splits {m.cols} inputs into {width} per rank: {e}") from e


def _copy_vectors(model: nn.Module, gguf: GGUFFile, family: Family, permuted: bool, config) -> None:
    """Norm weights and biases from the file into the materialised parameters (q and k biases of a
    `permuted` file in Hugging Face's row order); every parameter must be filled by what the file holds."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    params = dict(model.named_parameters())
    filled: dict[str, set] = {}
    for name in gguf.tensors:
        target = _vector_target(name, family)
        if target is None:
            continue
        param_name, shard = target
        if param_name not in params:
            raise GGUFError(f"tensor {name} has no parameter {param_name} in this model")
        value = _dequantized_vector(gguf, name)
        if family.norm_plus_one and param_name.endswith("norm.weight"):
            value = value - 1.0  # srt's Gemma norm multiplies by 1 + w itself
        if permuted and shard in ("q", "k"):
            value = value[unpermute_index(value.numel(), heads if shard == "q" else kv_heads)]
        module_name, param = param_name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        dest = params[param_name].data
        if hasattr(module, "checkpoint_slice"):
            dest, value = module.checkpoint_slice(param, shard, value)
        if dest.shape != value.shape:
            raise GGUFError(f"tensor {name}: shape {tuple(value.shape)}, the model's {tuple(dest.shape)}")
        dest.copy_(value)
        filled.setdefault(param_name, set()).add(shard)
    missing = [n for n, p in params.items() if n not in filled]
    if missing:
        raise GGUFError(f"the file has no tensor for {missing[:4]}")


def _vector_target(name: str, family: Family) -> tuple[str, str | None] | None:
    """(parameter, fused shard) of a norm or bias tensor; None for the weight matrices (installed)."""
    if name == FINAL_NORM:
        return "model.norm.weight", None
    if name in (EMBEDDING, HEAD, ROPE_FREQS):
        return None
    m = BLOCK_TENSOR.match(name)
    if m is None:
        raise GGUFError(f"tensor {name} is not one srt knows how to load")
    layer, kind, what = m.groups()
    if kind in LINEAR_PARTS:
        if what == "weight":
            return None
        module, shard = LINEAR_PARTS[kind]
        return f"model.layers.{layer}.{module}.bias", shard
    if kind in family.norms and what == "weight":
        return f"model.layers.{layer}.{family.norms[kind]}.weight", None
    raise GGUFError(f"tensor {name} is not one srt knows how to load")


def _dequantized_vector(gguf: GGUFFile, name: str) -> torch.Tensor:
    t = gguf.tensors[name]
    raw = gguf.raw(name).reshape(-1)
    kinds = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16}
    if t.ggml_type not in kinds or len(t.shape) != 1:
        raise GGUFError(
            f"tensor {name} is a {t.type_name} {t.shape}; srt reads norms and biases as 1-D F32/F16"
        )
    return raw.view(kinds[GGMLQuantizationType(t.ggml_type)]).float()
