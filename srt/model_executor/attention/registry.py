"""Attention backends by name. Importable without torch (classes are named by import path and loaded on
demand) so the CLI choices can come from here; `srt.server_args.ATTENTION_BACKENDS` must equal
`BACKEND_NAMES` (a unit test checks it)."""

from __future__ import annotations

import importlib
import importlib.util

_BACKENDS: dict[str, str] = {
    "torch_native": "srt.model_executor.attention.torch_native:TorchNativeAttnBackend",
    "flashinfer": "srt.model_executor.attention.flashinfer:FlashInferAttnBackend",
}
BACKEND_NAMES: tuple[str, ...] = tuple(_BACKENDS)
CPU_DEFAULT = "torch_native"
CUDA_PREFERRED = "flashinfer"


def flashinfer_usable(device: str) -> bool:
    """flashinfer needs a CUDA device and the installed package."""
    return device.startswith("cuda") and importlib.util.find_spec("flashinfer") is not None


def default_backend_name(device: str) -> str:
    return CUDA_PREFERRED if flashinfer_usable(device) else CPU_DEFAULT


def backend_class(name: str) -> type:
    """The backend class for `name`; raises ValueError for an unknown or unusable name."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def resolve_backend_name(requested: str | None, device: str) -> str:
    name = requested or default_backend_name(device)
    if name == CUDA_PREFERRED and not flashinfer_usable(device):
        raise ValueError("attention backend 'flashinfer' needs a CUDA device and the flashinfer package")
    backend_class(name)  # validates the name
    return name
