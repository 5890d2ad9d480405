"""What the runner asks of an adapter pool, so that it builds and drives one without importing srt/lora/.

srt/lora/ sits above this package (its `LoRALinearMethod` wraps the layers' linear methods, its manager reads
`ForwardBatch`); the runner meets it only through these two protocols, which `LoRAConfig` and `LoRAManager`
(srt/lora/manager.py) implement. The scheduler's side uses more of the manager (loads, unloads, admission,
snapshots: srt/lora/__init__.py states that contract). Torch-free at run time, like `RunnerConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from srt.model_executor.forward_batch_info import ForwardBatch
    from srt.model_executor.parallel_state import TensorParallelGroup


class AdapterPool(Protocol):
    """The per-step side: `prepare_step` gives each sequence's slot for `ForwardBatch.lora_slots`, in the
    batch's order (None: the base model); `begin_step` derives what the adapted layers read, once per step,
    before the forward pass."""

    def prepare_step(self, names: Sequence[str | None]) -> list[int]: ...

    def begin_step(self, batch: ForwardBatch) -> None: ...


class AdapterPoolConfig(Protocol):
    """A pool's configuration (`RunnerConfig.lora`): `build` wraps `model`'s adaptable layers and allocates
    the pool. The runner calls it once the weights are loaded and before it sizes the KV pool (the pool's
    memory counts) and installs int8 weights (through the wrapped methods)."""

    def build(
        self, model: nn.Module, tp: TensorParallelGroup, dtype: torch.dtype, device: str
    ) -> AdapterPool: ...
