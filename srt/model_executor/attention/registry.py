"""Attention backends by name (srt.engine_options.ATTENTION_BACKENDS, the CLI's choices), each class named by
import path and loaded on demand; a unit test checks that every name has one."""

from __future__ import annotations

import importlib
import importlib.util
import os

_BACKENDS: dict[str, str] = {
    "torch_native": "srt.model_executor.attention.torch_native:TorchNativeAttnBackend",
    "flashinfer": "srt.model_executor.attention.flashinfer:FlashInferAttnBackend",
    "triton": "srt.model_executor.attention.triton_backend:TritonAttnBackend",
}
BACKEND_NAMES: tuple[str, ...] = tuple(_BACKENDS)
CPU_DEFAULT = "torch_native"
# Triton on CUDA: it reads K/V in place, runs every layer kind (windows, soft-caps, any scale, any head
# size it was built for) and keeps decode graph-capturable (triton_backend.py). flashinfer, opt-in, plans
# per step on the host, so its decode is not captured in graphs, and it has no fp32 or small-head kernels.
CUDA_DEFAULT = "triton"
FLASHINFER = "flashinfer"


def flashinfer_usable(device: str) -> bool:
    """flashinfer needs a CUDA device and the installed package."""
    return device.startswith("cuda") and importlib.util.find_spec("flashinfer") is not None


def triton_usable(device: str) -> bool:
    """Triton kernels need the package and a CUDA device, or its CPU interpreter (TRITON_INTERPRET=1)."""
    runnable = device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"
    return runnable and importlib.util.find_spec("triton") is not None


def default_backend_name(device: str) -> str:
    if device.startswith("cuda") and triton_usable(device):
        return CUDA_DEFAULT
    return CPU_DEFAULT


def backend_class(name: str) -> type:
    """The backend class for `name`; raises ValueError for an unknown or unusable name."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def resolve_backend_name(requested: str | None, device: str) -> str:
    name = requested or default_backend_name(device)
    if name == FLASHINFER and not flashinfer_usable(device):
        raise ValueError("attention backend 'flashinfer' needs a CUDA device and the flashinfer package")
    if name == CUDA_DEFAULT and not triton_usable(device):
        raise ValueError(
            "attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1) and the triton package"
        )
    backend_class(name)  # validates the name
    return name
