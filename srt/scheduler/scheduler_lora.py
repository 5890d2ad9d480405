"""The scheduler's side of multi-LoRA (docs/lora.md): adapters loaded and unloaded between steps, each step's
adapter slots, and what the metrics read. The model side (weights, slots, the per-step products) is the
runner's `LoRAManager` (srt/lora/).

- Loading reads the files off the scheduler loop, on a worker thread, and adds the adapter between steps
  (`poll`, at the start of a step); other requests keep running meanwhile. With tensor parallelism every
  rank must add it at the same step, so ranks read it in the loop, when the message arrives (the step waits
  for the read), and add it at the next step's start.
- Unloading drains: the adapter stops taking requests at once (the HTTP process stops routing to it; a
  request that still arrives here is refused), the requests running with it finish, and then its weights
  and its prefix-cache namespace are freed and the reply goes out.
- Every step's adapters fit the pool's slots (srt/lora/slots.py states the invariant). Admission keeps it
  (`fits`): a request whose adapter does not fit next to the running ones waits, and the requests after it
  may go first. A pin keeps it by being refused (a failed reply naming `pinned`) while the running requests'
  adapters need the slot it would take; the caller pins later, or loads it unpinned.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from srt.io_struct import FinishReason, LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from srt.lora.adapter import AdapterError
from srt.lora.specs import check_adapter_name, echo

if TYPE_CHECKING:
    from srt.lora.manager import LoRAManager
    from srt.mem_cache.base_prefix_cache import BasePrefixCache
    from srt.scheduler.schedule_batch import Req

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoRALoad:
    """What the LoRA metrics read after a step: adapters of the running and of the waiting requests (sorted,
    each a loaded adapter's name), and the pool."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    slots_used: int
    slots_total: int
    loaded: tuple[tuple[str, bool], ...]  # (name, pinned) of every loaded adapter


class SchedulerLoRA:
    def __init__(self, manager: LoRAManager, tree_cache: BasePrefixCache, read_in_loop: bool):
        self.manager = manager
        self.tree_cache = tree_cache
        self._reader = None if read_in_loop else ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self._loading: list[tuple[LoadLoRAAdapterReq, Future]] = []
        self.draining: dict[str, list[str]] = {}  # adapter -> request ids of the unloads waiting on it
        self.replies: list[LoRAAdapterReqOutput] = []

    @property
    def busy(self) -> bool:
        """Loads or unloads are in progress: the loop must keep turning to finish them."""
        return bool(self._loading or self.draining)

    # ---- messages ----
    def load(self, msg: LoadLoRAAdapterReq) -> None:
        """Start reading the adapter; `poll` adds it (the HTTP process checks the message first: a guard)."""
        known = [*self.manager.adapters, *(m.lora_name for m, _ in self._loading)]
        problem = check_adapter_name(msg.lora_name, known)
        if problem is None and msg.lora_name in known:
            problem = f"LoRA adapter {echo(msg.lora_name)} is already loaded"
        if problem is not None:
            self.replies.append(LoRAAdapterReqOutput(msg.request_id, False, problem))
            return
        if self._reader is None:
            future: Future = Future()
            try:
                future.set_result(self.manager.read(msg.lora_name, msg.lora_path))
            except Exception as e:  # AdapterError, or anything reading the files raised
                future.set_exception(e)
        else:
            future = self._reader.submit(self.manager.read, msg.lora_name, msg.lora_path)
        self._loading.append((msg, future))

    def unload(self, msg: UnloadLoRAAdapterReq) -> None:
        """Stop taking requests for the adapter; `poll` frees it once its requests have finished."""
        if msg.lora_name not in self.manager.adapters:
            self.replies.append(
                LoRAAdapterReqOutput(
                    msg.request_id, False, f"LoRA adapter {echo(msg.lora_name)} is not loaded"
                )
            )
            return
        self.draining.setdefault(msg.lora_name, []).append(msg.request_id)

    def poll(self, live: list[Req], running: list[Req]) -> None:
        """At the start of a step: add the adapters whose files are read, unload the drained ones. `live`:
        every request the scheduler holds; `running`: those whose adapters the step serves whatever
        admission decides (the running batch and a prompt mid-chunk)."""
        in_use = sorted({r.lora_name for r in running if r.lora_name is not None})
        pending = []
        for msg, future in self._loading:
            if not future.done():
                pending.append((msg, future))
                continue
            try:
                self.manager.add(future.result(), msg.pinned, in_use)
            except AdapterError as e:  # one line, its echoes capped
                self.replies.append(LoRAAdapterReqOutput(msg.request_id, False, str(e), e.param))
                continue
            except Exception as e:  # anything else reading the files raised
                message = f"LoRA adapter {echo(msg.lora_name)}: reading it failed: {type(e).__name__}: {echo(str(e))}"
                self.replies.append(LoRAAdapterReqOutput(msg.request_id, False, message, "lora_path"))
                continue
            logger.info(
                "LoRA adapter %r loaded from %s%s", msg.lora_name, msg.lora_path, " (pinned)" * msg.pinned
            )
            self.replies.append(LoRAAdapterReqOutput(msg.request_id, True, ""))
        self._loading = pending
        if not self.draining:
            return
        in_use = {r.lora_name for r in live}
        for name in [n for n in self.draining if n not in in_use]:
            self.manager.unload(name)
            self.tree_cache.drop_namespace(name)
            logger.info("LoRA adapter %r unloaded", name)
            self.replies.extend(LoRAAdapterReqOutput(rid, True, "") for rid in self.draining.pop(name))

    def take_replies(self) -> list[LoRAAdapterReqOutput]:
        replies, self.replies = self.replies, []
        return replies

    # ---- requests and steps ----
    def refusal(self, name: str | None) -> FinishReason | None:
        """Why a request for adapter `name` cannot run here (the HTTP process checks first: a guard)."""
        if name is None:
            return None
        if name not in self.manager.adapters or name in self.draining:
            return FinishReason("error", message=f"LoRA adapter {name!r} is not loaded", param="model")
        return None

    def fits(self, names: list[str | None]) -> bool:
        return self.manager.fits(names)

    def slots(self, reqs: list[Req]) -> list[int]:
        """Each request's adapter slot, in the step's order (`ForwardBatch.lora_slots`)."""
        return self.manager.prepare_step([r.lora_name for r in reqs])

    def snapshot(self, running: list[Req], waiting: list[Req]) -> LoRALoad:
        pool = self.manager.snapshot()
        return LoRALoad(
            running=tuple(sorted({r.lora_name for r in running if r.lora_name is not None})),
            waiting=tuple(sorted({r.lora_name for r in waiting if r.lora_name is not None})),
            slots_used=pool.slots_used,
            slots_total=pool.slots_total,
            loaded=pool.adapters,
        )
