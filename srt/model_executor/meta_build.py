"""Constructing a model on the `meta` device, in the dtype it will hold: no random initialisation of weights
that a loader overwrites at once, and no memory until the loader materialises what it keeps. Both loaders
(`model_loader.load_model` for a directory, `gguf_loader.build_model` for a GGUF's blocks) build this way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def on_meta_device(dtype: torch.dtype) -> Iterator[None]:
    """Modules created inside are on the meta device, their floating-point parameters of `dtype`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.set_default_dtype(previous)
