"""The w8a8_int8 steps of a runner's start, on either side of the stages that need the pools.

Before the checkpoint loads (`skip_cached`, load_model's `skip` hook): the int8 weights, from the cache or
calibrated one decoder layer at a time (`int8_layerwise`), so the fp32 weights they replace are never read,
and the lookup-only embedding is mapped rather than copied: the scheduler's peak memory at start is the int8
model's, not the fp32 one's (613 MB instead of 1366 MB when measured). After the pools exist (`install`):
install the weights through the layers' methods.
"""

from __future__ import annotations

import os
import time

import torch

from srt.heap import release_free_heap
from srt.model_executor import int8_layerwise
from srt.model_executor.layers.int8_math import Int8Weight
from srt.model_executor.model_loader import map_checkpoint_tensor
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.quantization import cache_path, install_int8_weights, replaced_weights


class Int8Startup:
    """One runner's int8 start: what `skip_cached` found in the cache, kept for `install`."""

    def __init__(self, model_dir: str, device: str, tp: TensorParallelGroup):
        self.model_dir = model_dir
        self.device = device
        self.tp = tp
        self.weights: dict[str, Int8Weight] | None = None  # None until `skip_cached`
        self.source = "cache"  # where `skip_cached` found them, for the log: "cache" or "calibration"
        self.started = 0.0  # when `skip_cached` began (monotonic), for the log
        self.mapped_embedding: torch.Tensor | None = None

    def skip_cached(self, model: torch.nn.Module) -> set[str]:
        """The parameters the loader need not read: those the int8 weights replace and the embedding when it
        can be mapped. `model` is still on meta: the int8 weights come from the cache, or where any rank
        lacks its file, from calibrating one layer at a time (`int8_layerwise`), never the whole fp32 model."""
        self.started = time.monotonic()
        if not os.path.exists(cache_path(self.model_dir, self.tp.rank, self.tp.size)):
            self.source = "calibration"
        self.weights = int8_layerwise.int8_weights(model, self.model_dir, self.tp, self.device)
        skipped = replaced_weights(model)
        self.mapped_embedding = self._map_embedding(model)
        return skipped | {model.EMBEDDING_WEIGHT} if self.mapped_embedding is not None else skipped

    def after_load(self, model: torch.nn.Module) -> None:
        """Give the loaded model the embedding `skip_cached` mapped instead of loading it."""
        if self.mapped_embedding is not None:
            model.input_embedding.weight = torch.nn.Parameter(self.mapped_embedding, requires_grad=False)

    def install(self, model: torch.nn.Module) -> None:
        """The int8 weights `skip_cached` found or calibrated into the layers' methods."""
        install_int8_weights(model, self.weights, self.source, self.started)
        release_free_heap()  # the dropped fp32 weights

    def _map_embedding(self, model: torch.nn.Module) -> torch.Tensor | None:
        """The embedding table as a private map of the checkpoint (see map_checkpoint_tensor), where the
        checkpoint stores it as the model holds it and this is the CPU."""
        if self.device != "cpu":
            return None
        return map_checkpoint_tensor(self.model_dir, model.EMBEDDING_WEIGHT, model.input_embedding.weight)
