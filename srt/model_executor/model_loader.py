"""Builds the model for a Hugging Face directory and fills its parameters from the safetensors files.

The model is constructed on the `meta` device (no random initialisation of ~100M parameters that are
overwritten at once), materialised empty on the target device, then every parameter is copied from the
checkpoint through the model's declarative `STACKED_PARAMS` mapping (a class attribute of each model). A tensor-parallel layer picks this
rank's slice of each tensor (`checkpoint_slice`); other parameters are replicated whole. A parameter (or
fused shard) that no checkpoint tensor filled is an error, never silently random.

A checkpoint that stores a fused layer already fused (Phi-3's `qkv_proj` and `gate_up_proj`) is split into
the layer's shards first, in the order the model's `FUSED_CHECKPOINT_PARAMS` names them and at the layer's
own shard sizes, so each shard is sliced per rank like a separately stored one (a rank's q, k and v heads
are not one contiguous run of the fused tensor).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import struct
from collections.abc import Callable, Collection, Iterator

import torch
from safetensors import safe_open
from torch import nn

from srt.model_executor.layers.linear import ColumnParallelLinear
from srt.model_executor.layers.linear_method import UNQUANTIZED, LayerMethods
from srt.model_executor.meta_build import on_meta_device
from srt.model_executor.models.registry import get_model_class
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.quantization import GGUF_FILE_QUANTIZATIONS, resolve_quantization
from srt.model_source import is_gguf_file, resolve_model_dir

logger = logging.getLogger(__name__)

SAFETENSORS_GLOB = "*.safetensors"


def iter_checkpoint(
    model_dir: str, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors file in `model_dir` (whose name `wanted` takes:
    the others are never read)."""
    files = sorted(glob.glob(os.path.join(model_dir, SAFETENSORS_GLOB)))
    if not files:
        raise FileNotFoundError(f"no {SAFETENSORS_GLOB} files in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if wanted is None or wanted(name):
                    yield name, f.get_tensor(name)


def load_weights(
    model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], skip: Collection[str] = ()
) -> None:
    """Copy checkpoint tensors into `model`, mapping q/k/v and gate/up onto their fused slices and taking
    this rank's slice for tensor-parallel layers. Parameters named in `skip` are neither read nor required
    (their values come from elsewhere: the int8 cache)."""
    params = {name: p for name, p in model.named_parameters() if name not in skip}
    expected = {name: _shards_of(model, name) for name in params}
    loaded: dict[str, set[str | None]] = {name: set() for name in params}
    for ckpt_name, tensor in weights:
        if model.skip_weight(ckpt_name):
            continue
        name, mapped_shard = _map_name(model, ckpt_name)
        if name in skip:
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {ckpt_name!r} has no matching parameter")
        module_name, param = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        for shard, part in _checkpoint_shards(model, module_name, module, mapped_shard, tensor, ckpt_name):
            target = params[name].data
            if hasattr(module, "checkpoint_slice"):
                target, part = module.checkpoint_slice(param, shard, part)
            if target.shape != part.shape:
                raise ValueError(
                    f"{ckpt_name}: checkpoint shape {tuple(part.shape)} != {tuple(target.shape)}"
                )
            target.copy_(part)
            loaded[name].add(shard)
    missing = [name for name, shards in expected.items() if loaded[name] != shards]
    if missing:
        raise ValueError(
            f"parameters not found in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )


def _map_name(model: nn.Module, ckpt_name: str) -> tuple[str, object]:
    """Our parameter (and shard) for a checkpoint tensor: experts' tensors through the model's `EXPERT_PARAMS`
    into stacked parameters (shard: (projection, expert)), then `RENAMES`, then fused q/k/v and gate/up
    through `STACKED_PARAMS` (shard: the part)."""
    for pattern, param, shard in getattr(model, "EXPERT_PARAMS", ()):
        m = re.search(pattern, ckpt_name)
        if m is not None:
            return ckpt_name[: m.start()] + param, (shard, int(m.group(1)))
    for old, new in getattr(model, "RENAMES", ()):
        ckpt_name = ckpt_name.replace(old, new)
    for fused, part, shard in model.STACKED_PARAMS:
        if f".{part}." in ckpt_name:
            return ckpt_name.replace(f".{part}.", f".{fused}."), shard
    return ckpt_name, None


def _checkpoint_shards(
    model: nn.Module, module_name: str, module: nn.Module, shard, tensor: torch.Tensor, ckpt_name: str
) -> list[tuple[object, torch.Tensor]]:
    """(shard, tensor) pairs for one checkpoint tensor: itself, or, where the model declares the module's
    checkpoint tensor fused (`FUSED_CHECKPOINT_PARAMS`: module name -> its shards in checkpoint order), its
    rows split at the shards' full (all ranks') sizes."""
    fused = getattr(model, "FUSED_CHECKPOINT_PARAMS", {}).get(module_name.rsplit(".", 1)[-1])
    if fused is None or shard is not None:
        return [(shard, tensor)]
    sizes = [_full_shard_size(module, s) for s in fused]
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"{ckpt_name}: {tensor.shape[0]} rows, not the {sum(sizes)} of its shards {fused}")
    return list(zip(fused, tensor.split(sizes), strict=True))


def _full_shard_size(module: ColumnParallelLinear, shard: str) -> int:
    """A shard's output size over all ranks (the layer holds this rank's share of each)."""
    return module.shard_offsets[shard][1] * module.tp.size


def _shards_of(model: nn.Module, param_name: str) -> set:
    module_name, param = param_name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    if hasattr(module, "checkpoint_shards"):
        return module.checkpoint_shards(param)
    return set(module.shard_offsets) if isinstance(module, ColumnParallelLinear) else {None}


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def map_checkpoint_tensor(model_dir: str, name: str, like: torch.Tensor) -> torch.Tensor | None:
    """`name` from the checkpoint as a read-only memory map instead of a copy, where it is stored whole with
    `like`'s dtype and shape (None otherwise). Only the pages a kernel reads become resident, and they are
    the page cache's, which the kernel can drop: an embedding table that is only looked up (its tokens'
    rows) then costs a few MB instead of its whole size (113 MB for SmolLM2's 49k x 576 fp32). Private
    mapping: nothing ever writes it, and the checkpoint file is never modified through it."""
    for path in sorted(glob.glob(os.path.join(model_dir, SAFETENSORS_GLOB))):
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
        except (OSError, ValueError, struct.error):
            return None
        entry = header.get(name)
        if entry is None:
            continue
        begin, end = entry["data_offsets"]
        offset = 8 + header_len + begin
        if (
            SAFETENSORS_DTYPES.get(entry["dtype"]) != like.dtype
            or list(entry["shape"]) != list(like.shape)
            or end - begin != like.numel() * like.element_size()
            or offset % like.element_size()
        ):
            return None
        storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
        return torch.empty(0, dtype=like.dtype).set_(storage, offset // like.element_size(), like.shape)
    return None


def load_model(
    model_dir: str,
    hf_config,
    max_positions: int,
    dtype: torch.dtype,
    device: str,
    tp: TensorParallelGroup | None = None,
    skip: Callable[[nn.Module], Collection[str]] | None = None,
    methods: LayerMethods = UNQUANTIZED,
) -> nn.Module:
    """The model, its layers built with `methods`, with the checkpoint's weights, except the parameters `skip` names when shown the model's
    structure (on the meta device, before any memory is allocated): those stay uninitialised, and their
    pages are never touched, for the caller to replace."""
    arch, model_class = get_model_class(hf_config.architectures)
    with on_meta_device(dtype):
        model = model_class(hf_config, arch, max_positions, dtype, device, tp, methods)
    skipped = skip(model) if skip is not None else ()
    model = model.to_empty(device=device)
    load_parameters(model, model_dir, {name for name, _ in model.named_parameters()} - set(skipped))
    model.eval().requires_grad_(False)
    logger.info("loaded %s (%s) from %s", arch, dtype, model_dir)
    return model


def load_parameters(model: nn.Module, model_dir: str, names: Collection[str]) -> None:
    """Fill the parameters `names` of `model` from the checkpoint in `model_dir`; the checkpoint's other
    tensors are never read and the model's other parameters stay as they are (on the meta device, while
    `int8_layerwise` calibrates one layer of it at a time)."""
    names = set(names)
    skipped = {name for name, _ in model.named_parameters()} - names
    load_weights(model, iter_checkpoint(model_dir, lambda name: _map_name(model, name)[0] in names), skipped)


class HFCheckpoint:
    """A Hugging Face safetensors directory as the model runner reads a checkpoint: its config, EOS ids and
    `load_model` (`gguf_loader.GGUFCheckpoint` is the same for a GGUF's blocks)."""

    def __init__(self, model_dir: str):
        from transformers import AutoConfig

        from srt.model_executor.runner_setup import eos_token_ids_of

        self.path = model_dir
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.eos_token_ids = eos_token_ids_of(model_dir, self.hf_config)

    def load_model(self, max_positions, dtype, device, tp, methods, skip=None) -> nn.Module:
        return load_model(self.path, self.hf_config, max_positions, dtype, device, tp, skip, methods)


def open_checkpoint(path: str, requested: str | None, device: str):
    """(the checkpoint a runner loads from `path`, a directory or a .gguf file, and the quantization it runs
    with): a GGUF's own blocks under `gguf`, or int8 made from them under `gguf_int8` (on the CPU, unasked,
    whichever the measured rule picks for the file's size), else the dense weights (a GGUF converted once,
    `model_source.resolve_model_dir`). The one place that tells the two apart.

    A GGUF holding a block type the kernels cannot run is refused in one line naming the tensor and the type
    (a start-up configuration error, exit 2), never served some other way behind the user's back: the user
    may ask for the converted weights with `--quantization w8a8_int8` or `none`."""
    if not is_gguf_file(path):
        return HFCheckpoint(path), resolve_quantization(requested, device)
    quantization = resolve_quantization(requested, device, gguf=True)
    if quantization in GGUF_FILE_QUANTIZATIONS:
        from srt.model_executor.gguf_file import GGUFError
        from srt.model_executor.gguf_loader import GGUFCheckpoint

        # unasked, the file's blocks or int8 made from them, by the file's size (gguf_int8.gguf_method)
        checkpoint = GGUFCheckpoint(path, requested)
        if checkpoint.refusal is None:
            return checkpoint, checkpoint.quantization
        raise GGUFError(
            f"{checkpoint.refusal} (--quantization w8a8_int8 or none serves its converted weights)"
        )
    return HFCheckpoint(resolve_model_dir(path)), quantization


def checkpoint_config(path: str):
    """The transformers config of a directory or a .gguf file, read without loading or converting anything
    (a launcher's checks before the runners start)."""
    if is_gguf_file(path):
        from srt.model_executor.gguf_config import gguf_config
        from srt.model_executor.gguf_file import GGUFFile

        return gguf_config(GGUFFile.open(path))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)
