"""Builds srt's model straight from a GGUF file's quantized blocks: nothing converted, calibrated or cached.

The file is parsed and validated once (`gguf_file.GGUFFile`); its metadata becomes a transformers config of
the family (what `config.json` would say: `gguf_config.py`), the model is built on the meta device, and then:
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

import torch
from gguf.constants import GGMLQuantizationType
from torch import nn

from srt.model_executor.gguf_config import (
    EMBEDDING,
    HEAD,
    ROPE_FREQS,
    Family,
    eos_token_ids,
    gguf_config,
    gguf_family,
)
from srt.model_executor.gguf_file import GGUFError, GGUFFile
from srt.model_executor.gguf_int8 import BlockInstaller, gguf_method
from srt.model_executor.layers.block_embedding import BlockEmbedding
from srt.model_executor.layers.gguf_linear import SUPPORTED_TYPES, BlockMatrix
from srt.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from srt.model_executor.layers.linear_method import LayerMethods
from srt.model_executor.meta_build import on_meta_device
from srt.model_executor.models.registry import get_model_class
from srt.model_executor.parallel_state import TensorParallelGroup

logger = logging.getLogger(__name__)

FINAL_NORM = "output_norm.weight"
BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Llama-layer files whose q/k rows llama.cpp permuted for its rotary embedding
PERMUTED_QK_ARCHS = ("llama",)
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
