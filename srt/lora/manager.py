"""The runner's LoRA side: the loaded adapters, the weight pool, and the per-step slot assignment.

Built by `ModelRunner` from a `LoRAConfig` (`LoRAConfig.build`) once the model's weights are loaded (before any int8
quantization, whose methods it wraps): it finds the model's adaptable layers by their checkpoint module
names (the model's declarative `STACKED_PARAMS` says which sub-modules a fused layer stacks), gives each a
`LoRALinearMethod` around its own method and its slots in the pool, and from then on changes only weights.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from srt.lora.adapter import AdapterError, LoRAAdapter, read_adapter
from srt.lora.batch_info import LoRABatchInfo, LoRAStep
from srt.lora.config import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS_PER_BATCH,
    LORA_BACKENDS,
    LORA_TARGET_MODULES,
)
from srt.lora.lora_linear import LayerLoRAWeights, LoRALinearMethod, SubModule
from srt.lora.slots import SlotTable
from srt.model_executor.attention.registry import triton_usable
from srt.model_executor.forward_batch_info import NO_ADAPTER, ForwardBatch
from srt.model_executor.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from srt.model_executor.layers.linear_method import WEIGHT
from srt.model_executor.parallel_state import TensorParallelGroup

logger = logging.getLogger(__name__)

# A decoder layer's module path, as PEFT names it too (model.layers.3.self_attn.qkv_proj)
DECODER_MODULE = re.compile(r"^model\.layers\.\d+\.\w+\.(?P<leaf>\w+)$")


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras_per_batch`: pool slots, the most distinct adapters one step serves. `max_loaded_loras`: the
    most adapters held in host memory at once (None: no limit); loading one more is refused rather than
    silently dropping one a client may still name. `max_lora_rank`: the largest rank the pool takes.
    `target_modules`: the modules adapters may adapt (a subset of LORA_TARGET_MODULES). `backend`: one of
    LORA_BACKENDS."""

    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    max_loaded_loras: int | None = None
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    backend: str = LORA_BACKENDS[0]

    def __post_init__(self):
        unknown = sorted(set(self.target_modules) - set(LORA_TARGET_MODULES))
        if unknown:
            raise ValueError(f"LoRA target modules {unknown} are not among {list(LORA_TARGET_MODULES)}")
        if self.max_loras_per_batch < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras_per_batch and max_lora_rank must be at least 1")
        if self.backend not in LORA_BACKENDS:
            raise ValueError(f"LoRA backend {self.backend!r} is not among {list(LORA_BACKENDS)}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < 1:
            raise ValueError("max_loaded_loras must be at least 1 (or None: no limit)")

    def build(
        self, model: nn.Module, tp: TensorParallelGroup, dtype: torch.dtype, device: str
    ) -> LoRAManager:
        """The pool over `model`'s adaptable layers (`AdapterPoolConfig`, the seam through which the runner
        builds it without importing srt.lora)."""
        return LoRAManager(model, self, tp, dtype, device)


@dataclass(frozen=True)
class LoRAPoolSnapshot:
    """What the pool's gauges read (sglang:lora_pool_slots_*, a per-adapter loaded gauge), taken by the
    scheduler after a step: observers never hold the manager itself."""

    slots_used: int
    slots_total: int
    adapters: tuple[tuple[str, bool], ...]  # every loaded adapter, idle or not, and whether it is pinned


class LoRAManager:
    """Every tensor-parallel rank holds one and must be given the same calls in the same order (the slot
    assignment is deterministic, so every rank puts an adapter in the same slot)."""

    def __init__(
        self, model: nn.Module, config: LoRAConfig, tp: TensorParallelGroup, dtype: torch.dtype, device: str
    ):
        self.config = config
        self.kernels = getattr(model, "kernels", None)  # srt's CPU kernels, where the model has them
        if config.backend == "triton" and not triton_usable(device):
            raise ValueError(
                "--lora-backend triton needs a CUDA device (or TRITON_INTERPRET=1) and the triton package"
            )
        self.step = LoRAStep()
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots = SlotTable(config.max_loras_per_batch)
        self._slot_ranks = [0] * config.max_loras_per_batch
        # the latest step's layout (slots, rows per sequence, ranks) and its info, reused while it repeats
        self._last_layout: tuple | None = None
        self._last_info: LoRABatchInfo | None = None
        self.layers: list[LayerLoRAWeights] = []
        self.shapes: dict[str, tuple[int, int]] = {}  # PEFT module path -> (in, out) over all ranks
        stacked: dict[str, list[tuple[str, str]]] = {}
        for fused, part, shard in getattr(model, "STACKED_PARAMS", ()):
            stacked.setdefault(fused, []).append((part, shard))
        for name, module in model.named_modules():
            m = DECODER_MODULE.match(name)
            if m is None or not isinstance(module, LinearBase):
                continue
            leaf = m["leaf"]
            parts = stacked.get(leaf) or ([(leaf, None)] if leaf in LORA_TARGET_MODULES else [])
            parts = [(part, shard) for part, shard in parts if part in config.target_modules]
            if parts:
                weights = self._layer_weights(name, module, parts, tp, dtype, device)
                module.method = LoRALinearMethod(module.method, weights, self.step)
                self.layers.append(weights)
        pool_bytes = sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.a, layer.b))
        logger.info(
            "LoRA: %d linear layers adapted on %s; %d slots up to rank %d (%.1f MiB), %s",
            len(self.layers),
            ", ".join(config.target_modules),
            config.max_loras_per_batch,
            config.max_lora_rank,
            pool_bytes / 2**20,
            f"up to {config.max_loaded_loras} adapters loaded"
            if config.max_loaded_loras
            else "no limit on loaded adapters",
        )

    def _layer_weights(self, name, module, parts, tp, dtype, device) -> LayerLoRAWeights:
        parent = name.rsplit(".", 1)[0]
        out_local, in_full = module.weight_shape(WEIGHT)
        in_local, in_offset = in_full, None
        if isinstance(module, RowParallelLinear):
            in_local, in_offset, in_full = (
                module.in_local,
                tp.rank * module.in_local,
                module.in_local * tp.size,
            )
        subs = []
        for i, (part, shard) in enumerate(parts):
            offset, size, fan_out = 0, out_local, out_local
            if isinstance(module, ColumnParallelLinear):
                offset, size = module.shard_offsets[shard or next(iter(module.shard_offsets))]
                fan_out = size * tp.size
            subs.append(SubModule(f"{parent}.{part}", i, offset, size, fan_out))
            self.shapes[subs[-1].path] = (in_full, fan_out)
        cfg = self.config
        return LayerLoRAWeights(
            tuple(subs), in_local, out_local, in_offset, tp.rank, cfg.max_loras_per_batch, cfg.max_lora_rank,
            dtype, device, self.kernels, triton=cfg.backend == "triton",
        )  # fmt: skip

    # ---- adapters ----
    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter at `path`, checked against this model (AdapterError otherwise). Touches no state of
        the manager: a scheduler may run it on a worker thread, then `add` the result on its loop."""
        adapter = read_adapter(name, path, self.shapes, self.config.target_modules, self.config.max_lora_rank)
        if self.layers:
            dtype = self.layers[0].a.dtype
            limit = torch.finfo(dtype).max  # a factor beyond it would become inf in the pool
            for module, (a, b) in adapter.weights.items():
                if max(a.abs().max().item(), b.abs().max().item() * abs(adapter.scaling)) > limit:
                    raise AdapterError(name, f"{module} holds values beyond the adapter pool's {dtype} range")
        return adapter

    def add(self, adapter: LoRAAdapter, pinned: bool = False, in_use: Sequence[str] = ()) -> None:
        """Make a read adapter servable under its name; a pinned one takes a slot now and keeps it. `in_use`:
        the adapters of the requests running now, which keep their slots: a pin they leave no slot for is
        refused (AdapterError about `pinned`), since the next step could not serve them all."""
        name, limit = adapter.name, self.config.max_loaded_loras
        if name in self.adapters:
            raise AdapterError(name, "an adapter of this name is already loaded", param="lora_name")
        if limit is not None and len(self.adapters) >= limit:
            raise AdapterError(
                name, f"{limit} adapters are loaded (--max-loaded-loras); unload one first", param="lora_name"
            )
        if pinned and not self.slots.can_pin():
            raise AdapterError(
                name,
                f"pinned: pinning it would leave none of the {self.slots.num_slots} slots to unpinned adapters",
                param="pinned",
            )
        if pinned and not self.slots.can_pin(in_use):
            raise AdapterError(
                name,
                f"pinned: the running requests' adapters hold the slots a pin would take "
                f"({self.slots.num_slots} slots, {len(self.slots.pinned)} pinned); pin it once they finish, "
                "or load it with pinned false",
                param="pinned",
            )
        self.adapters[name] = adapter
        if pinned:
            slot, _ = self.slots.pin(name, in_use)
            self._write(slot, adapter)

    def load(self, name: str, path: str, pinned: bool = False) -> None:
        self.add(self.read(name, path), pinned)

    def unload(self, name: str) -> None:
        """Forget the adapter and free its slot. The caller first lets the requests using it finish."""
        if self.adapters.pop(name, None) is None:
            raise AdapterError(name, "no adapter of this name is loaded", param="lora_name")
        slot = self.slots.release(name)
        if slot is not None:
            self._clear(slot)

    @property
    def loaded(self) -> list[str]:
        return list(self.adapters)

    def is_pinned(self, name: str) -> bool:
        return name in self.slots.pinned

    def snapshot(self) -> LoRAPoolSnapshot:
        adapters = tuple((name, self.is_pinned(name)) for name in self.adapters)
        return LoRAPoolSnapshot(self.slots.used, self.slots.num_slots, adapters)

    # ---- steps ----
    def fits(self, names: Sequence[str | None]) -> bool:
        """Whether one step can serve these requests' adapters together (None: the base; admission's test)."""
        return self.slots.fits(n for n in names if n is not None)

    def prepare_step(self, names: Sequence[str | None]) -> list[int]:
        """Each request's slot (NO_ADAPTER for None) for `ForwardBatch.lora_slots`, loading missing adapters
        into slots (evicting the least recently used unpinned ones the step does not use). Every name must be
        loaded (KeyError otherwise) and the step must fit (`fits`, ValueError otherwise)."""
        distinct = list(dict.fromkeys(n for n in names if n is not None))
        for name in distinct:
            if name not in self.adapters:
                raise KeyError(f"LoRA adapter {name!r} is not loaded")
        for name, slot, _evicted in self.slots.place(distinct):
            self._write(slot, self.adapters[name])
        return [NO_ADAPTER if n is None else self.slots.slot_of[n] for n in names]

    def begin_step(self, batch: ForwardBatch) -> None:
        """Called by the runner before each forward pass: which rows every adapted layer adapts, with what.
        A decode step usually has the previous step's layout (the same requests, slots and ranks): then the
        previous info serves again."""
        if not batch.has_adapters:
            self.step.info = None
            return
        key = (tuple(batch.lora_slots), tuple(batch.new_token_counts()), tuple(self._slot_ranks))
        if key != self._last_layout:
            self._last_info = LoRABatchInfo.build(key[0], key[1], self._slot_ranks, batch.input_ids.device)
            self._last_layout = key
        self.step.info = self._last_info

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer in self.layers:
            layer.write(slot, adapter)
        self._slot_ranks[slot] = adapter.rank

    def _clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear(slot)
        self._slot_ranks[slot] = 0
