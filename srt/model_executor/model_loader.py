"""Builds the model for a Hugging Face directory and fills its parameters from the safetensors files.

The model is constructed on the `meta` device (no random initialisation of ~100M parameters that are
overwritten at once), materialised empty on the target device, then every parameter is copied from the
checkpoint through the model's declarative `STACKED_PARAMS` mapping. A tensor-parallel layer picks this
rank's slice of each tensor (`checkpoint_slice`); other parameters are replicated whole. A parameter (or
fused shard) that no checkpoint tensor filled is an error, never silently random.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from srt.model_executor.layers.linear import ColumnParallelLinear
from srt.model_executor.models.llama import STACKED_PARAMS
from srt.model_executor.models.registry import get_model_class
from srt.model_executor.parallel_state import TensorParallelGroup

logger = logging.getLogger(__name__)

SAFETENSORS_GLOB = "*.safetensors"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def iter_checkpoint(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors file in `model_dir`."""
    files = sorted(glob.glob(os.path.join(model_dir, SAFETENSORS_GLOB)))
    if not files:
        raise FileNotFoundError(f"no {SAFETENSORS_GLOB} files in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into `model`, mapping q/k/v and gate/up onto their fused slices and taking
    this rank's slice for tensor-parallel layers."""
    params = dict(model.named_parameters())
    expected = {name: _shards_of(model, name) for name in params}
    loaded: dict[str, set[str | None]] = {name: set() for name in params}
    for ckpt_name, tensor in weights:
        if model.skip_weight(ckpt_name):
            continue
        name, shard = _map_name(ckpt_name)
        if name not in params:
            raise KeyError(f"checkpoint tensor {ckpt_name!r} has no matching parameter")
        module_name, param = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        target = params[name].data
        if hasattr(module, "checkpoint_slice"):
            target, tensor = module.checkpoint_slice(param, shard, tensor)
        if target.shape != tensor.shape:
            raise ValueError(f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        target.copy_(tensor)
        loaded[name].add(shard)
    missing = [name for name, shards in expected.items() if loaded[name] != shards]
    if missing:
        raise ValueError(
            f"parameters not found in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )


def _map_name(ckpt_name: str) -> tuple[str, str | None]:
    for fused, part, shard in STACKED_PARAMS:
        if f".{part}." in ckpt_name:
            return ckpt_name.replace(f".{part}.", f".{fused}."), shard
    return ckpt_name, None


def _shards_of(model: nn.Module, param_name: str) -> set[str | None]:
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    return set(module.shard_offsets) if isinstance(module, ColumnParallelLinear) else {None}


def load_model(
    model_dir: str,
    hf_config,
    max_positions: int,
    dtype: torch.dtype,
    device: str,
    tp: TensorParallelGroup | None = None,
) -> nn.Module:
    arch, model_class = get_model_class(hf_config.architectures)
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(hf_config, arch, max_positions, dtype, device, tp)
    model = model.to_empty(device=device)
    load_weights(model, iter_checkpoint(model_dir))
    model.eval().requires_grad_(False)
    logger.info("loaded %s (%s) from %s", arch, dtype, model_dir)
    return model
