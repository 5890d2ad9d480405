"""Multi-LoRA serving on the model-executor side: many PEFT adapters over one base model, in one batch.

`config.py` is torch-free (flags and the HTTP process may import it); the rest runs in the scheduler. This
package sits above `srt.model_executor` (it wraps the layers' linear methods) and the runner never imports it:
it builds the pool through `srt.model_executor.adapters.AdapterPoolConfig`. The contract, for the scheduler:

- `ModelRunner(..., lora=LoRAConfig(max_loras_per_batch, max_loaded_loras, max_lora_rank, target_modules))`
  (`manager.py`) builds `runner.lora`, a `manager.LoRAManager` (`LoRAConfig.build`), and wraps the adaptable
  layers' linear methods (None: no LoRA).
- `runner.lora.load(name, path, pinned=False)` reads, checks and adds an adapter; it raises
  `adapter.AdapterError` (a ValueError whose message is one line naming the adapter and the problem: a
  400, or a start-up error).
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
