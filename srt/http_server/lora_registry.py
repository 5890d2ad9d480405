"""The adapters this server serves, as the HTTP process knows them (docs/lora.md): which names a request may
select, what `/v1/models` lists, and loading or unloading one across every scheduler.

A request selects an adapter by OpenAI's `model` (`"ADAPTER"` or `"BASE:ADAPTER"`) or `/generate`'s
`lora_path`; a name that is not served is OpenAI's 404 `model_not_found`. Loading sends
`LoadLoRAAdapterReq` to every data-parallel scheduler and serves the name only once all have added it;
unloading stops serving the name at once (new requests get the 404), then waits until every scheduler has
drained and freed it. One load or unload at a time.

A load is untrusted input: its name passes the same rule as the start-up adapters' (`check_adapter_name`,
against every served name), and its path must resolve to a directory under the allowed directories
(--lora-allowed-dirs); a missing path and a forbidden one get the same 400, so the answer reveals nothing
of the file system outside them. The schedulers read the resolved path.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from srt.io_struct import LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq
from srt.lora.specs import AdapterSpec, check_adapter_name, confine_adapter_path, echo

# A load reads the files and copies the weights; an unload waits for the adapter's running requests.
LORA_REQUEST_TIMEOUT_SECONDS = 600.0


class AdapterNotFound(LookupError):
    """A request named an adapter this server does not serve (OpenAI's 404 model_not_found)."""


class AdapterRequestError(ValueError):
    """A load or unload that cannot be done (a 400 with this message; 404 when `not_found`); `param`: the
    request field it is about."""

    def __init__(self, message: str, not_found: bool = False, param: str = "lora_name"):
        super().__init__(message)
        self.not_found = not_found
        self.param = param


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    path: str
    pinned: bool = False


class LoRARegistry:
    """`send`: hands a message to every data-parallel scheduler (the TokenizerManager's sockets);
    `allowed_dirs`: the resolved directories a load may read under (`allowed_adapter_dirs`; empty: none)."""

    def __init__(
        self,
        base_name: str,
        startup: list[AdapterSpec],
        send: Callable[[object], None],
        ranks: int,
        allowed_dirs: tuple[str, ...] = (),
    ):
        self.base_name = base_name
        self.allowed_dirs = allowed_dirs
        self.adapters: dict[str, ServedAdapter] = {
            s.name: ServedAdapter(s.name, s.path, s.pinned) for s in startup
        }
        self._send = send
        self._ranks = ranks
        self._waiting: dict[str, tuple[asyncio.Future, list[LoRAAdapterReqOutput]]] = {}
        self._lock = asyncio.Lock()

    # ---- requests ----
    def resolve(self, model: str | None, lora_path: str | None = None) -> str | None:
        """The adapter a request runs with (None: the base model), from its `model` and `/generate`'s
        `lora_path`; AdapterNotFound for a name this server does not serve."""
        if lora_path is not None:
            if lora_path not in self.adapters:
                raise AdapterNotFound(lora_path)
            return lora_path
        if model is None or model == self.base_name:
            return None
        if model in self.adapters:
            return model
        base, sep, adapter = model.rpartition(":")
        if sep and base == self.base_name and adapter in self.adapters:
            return adapter
        raise AdapterNotFound(model)

    def served(self) -> list[ServedAdapter]:
        return sorted(self.adapters.values(), key=lambda a: a.name)

    # ---- load and unload ----
    async def load(self, name: object, path: object, pinned: object = False) -> None:
        if name == self.base_name:
            raise AdapterRequestError(f"{echo(name)} names the base model")
        problem = check_adapter_name(name)
        if problem is not None:
            raise AdapterRequestError(problem)
        if not isinstance(path, str) or not path:
            raise AdapterRequestError("lora_path must be a non-empty string", param="lora_path")
        if not isinstance(pinned, bool):
            raise AdapterRequestError("pinned must be true or false", param="pinned")
        real = confine_adapter_path(path, self.allowed_dirs)
        if real is None:  # missing or forbidden: one answer for both
            raise AdapterRequestError(
                f"lora_path {echo(path)} is not an adapter directory this server may load "
                "(see --lora-allowed-dirs)",
                param="lora_path",
            )
        async with self._lock:
            if name in self.adapters:
                raise AdapterRequestError(f"LoRA adapter {echo(name)} is already loaded")
            problem = check_adapter_name(
                name, [self.base_name, *self.adapters]
            )  # a look-alike of a served one
            if problem is not None:
                raise AdapterRequestError(problem)
            replies = await self._ask(lambda rid: LoadLoRAAdapterReq(rid, name, real, pinned))
            failed = [r for r in replies if not r.success]
            if failed:
                if len(failed) < len(replies):  # some replicas added it: take it back out of them
                    await self._ask(lambda rid: UnloadLoRAAdapterReq(rid, name))
                raise AdapterRequestError(failed[0].message, param=failed[0].param)
            self.adapters[name] = ServedAdapter(name, real, pinned)

    async def unload(self, name: object) -> None:
        async with self._lock:
            if not isinstance(name, str) or name not in self.adapters:
                raise AdapterRequestError(f"LoRA adapter {echo(name)} is not loaded", not_found=True)
            del self.adapters[name]  # no new request selects it from now on
            replies = await self._ask(lambda rid: UnloadLoRAAdapterReq(rid, name))
            failed = [r for r in replies if not r.success]
            if failed:
                raise AdapterRequestError(failed[0].message)

    def on_reply(self, reply: LoRAAdapterReqOutput) -> None:
        """A scheduler's answer (from the output loop)."""
        entry = self._waiting.get(reply.request_id)
        if entry is None:
            return
        future, replies = entry
        replies.append(reply)
        if len(replies) == self._ranks and not future.done():
            future.set_result(replies)

    def fail_all(self, reason: str) -> None:
        """A child died: no reply will come."""
        for future, _ in self._waiting.values():
            if not future.done():
                future.set_exception(AdapterRequestError(reason))

    async def _ask(self, make) -> list[LoRAAdapterReqOutput]:
        rid = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (future, [])
        try:
            self._send(make(rid))
            return await asyncio.wait_for(future, LORA_REQUEST_TIMEOUT_SECONDS)
        finally:
            del self._waiting[rid]
