"""The w8a8_int8 steps of a runner's start, on either side of the stages that need the pools.

Before the checkpoint loads (`skip_cached`, load_model's `skip` hook): with every rank's int8 weights cached,
the fp32 weights they replace are never read, and the lookup-only embedding is mapped rather than copied, so
the scheduler's peak memory at start is the int8 model's, not the fp32 one's (613 MB instead of 1366 MB when
measured). After the pools exist (`install`): calibrate where the cache had nothing (calibration runs the
fp32 model through the pools), install the weights, map the embedding if it is not mapped yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from srt.heap import release_free_heap
from srt.model_executor import int8_layerwise
from srt.model_executor.layers.int8_math import Int8Weight
from srt.model_executor.model_loader import map_checkpoint_tensor
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.quantization import (
    calibrated_int8_weights,
    install_int8_weights,
    replaced_weights,
)


class Int8Startup:
    """One runner's int8 start: what `skip_cached` found in the cache, kept for `install`."""

    def __init__(self, model_dir: str, device: str, tp: TensorParallelGroup):
        self.model_dir = model_dir
        self.device = device
        self.tp = tp
        self.weights: dict[str, Int8Weight] | None = None  # None: calibrate in `install`
        self.mapped_embedding: torch.Tensor | None = None

    def skip_cached(self, model: torch.nn.Module) -> set[str]:
        """The parameters the loader need not read: those the int8 weights replace and the embedding when it
        can be mapped. `model` is still on meta: the int8 weights come from the cache, or where any rank
        lacks its file, from calibrating one layer at a time (`int8_layerwise`), never the whole fp32 model."""
        self.weights = int8_layerwise.int8_weights(model, self.model_dir, self.tp, self.device)
        if self.weights is None:
            return set()
        skipped = replaced_weights(model)
        self.mapped_embedding = self._map_embedding(model)
        return skipped | {model.EMBEDDING_WEIGHT} if self.mapped_embedding is not None else skipped

    def after_load(self, model: torch.nn.Module) -> None:
        """Give the loaded model the embedding `skip_cached` mapped instead of loading it."""
        if self.mapped_embedding is not None:
            model.input_embedding.weight = torch.nn.Parameter(self.mapped_embedding, requires_grad=False)

    def install(
        self, model: torch.nn.Module, run_windows: Callable[[list[int], int], Iterable], max_window: int
    ) -> None:
        """The int8 weights into the layers' methods: the cached ones, else calibrated now by `run_windows`
        (the runner's teacher-forced forward). Once the int8 head has its own copy of a tied embedding, the
        fp32 table is only looked up: mapped from the checkpoint (only the rows of tokens seen become
        resident) instead of held."""
        source, started, weights = "cache", time.monotonic(), self.weights
        if weights is None:
            source = "calibration"
            weights = calibrated_int8_weights(model, self.model_dir, self.tp, run_windows, max_window)
        install_int8_weights(model, weights, source, started)
        if self.mapped_embedding is None:
            self.mapped_embedding = self._map_embedding(model)
            self.after_load(model)
        release_free_heap()  # the dropped fp32 weights

    def _map_embedding(self, model: torch.nn.Module) -> torch.Tensor | None:
        """The embedding table as a private map of the checkpoint (see map_checkpoint_tensor), where the
        checkpoint stores it as the model holds it and this is the CPU."""
        if self.device != "cpu":
            return None
        return map_checkpoint_tensor(self.model_dir, model.EMBEDDING_WEIGHT, model.input_embedding.weight)
