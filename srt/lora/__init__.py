"""Multi-LoRA serving on the model-executor side: many PEFT adapters over one base model, in one batch.

The contract, for the scheduler:

- `ModelRunner(..., lora=LoRAConfig(max_loras_per_batch, max_loaded_loras, max_lora_rank, target_modules))`
  builds `runner.lora`, a `LoRAManager`, and wraps the adaptable layers' linear methods (None: no LoRA).
- `runner.lora.load(name, path, pinned=False)` reads, checks and adds an adapter; it raises `AdapterError`
  (a ValueError whose message is one line naming the adapter and the problem: a 400, or a start-up error).
  To keep file reading off the scheduler loop, call `read(name, path)` on a worker thread and
  `add(adapter, pinned)` on the loop. `unload(name)` forgets one; call it only once no running request
  uses it (refuse new requests for it first). Every tensor-parallel rank gets the same calls.
- Per step: `fits(names)` says whether the requests' adapters (None for the base) can share one step
  (admission keeps to it: at most `max_loras_per_batch` distinct adapters, pinned ones counted);
  `prepare_step(names)` returns each request's slot, in the batch's sequence order, for
  `ForwardBatch.lora_slots`. The runner does the rest (`begin_step`) in `forward`.
- Gauges read `runner.lora.snapshot()`, a frozen `LoRAPoolSnapshot` (slots used and total, each loaded
  adapter and whether it is pinned).

The fused int8 CPU decode step runs adapter steps too, adding each layer's adapter products after its
kernel (`LinearMethod.add_adapters`). A step with adapter rows never replays a recorded decode CUDA graph
(recorded for the base alone); base-only steps still do.
"""

from srt.lora.adapter import AdapterError, LoRAAdapter
from srt.lora.config import LORA_TARGET_MODULES, LoRAConfig
from srt.lora.manager import LoRAManager, LoRAPoolSnapshot

__all__ = [
    "AdapterError",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRAManager",
    "LoRAPoolSnapshot",
    "LORA_TARGET_MODULES",
]
