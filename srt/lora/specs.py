"""The adapters a server loads at start: `--lora-paths` (SGLang's forms) and `--lora-modules` (vLLM's), read
into one list. Torch-free: `ServerArgs` validates them in the HTTP process.

Forms of one entry:
- `NAME=PATH`;
- `PATH` alone (SGLang: the adapter is named by its path);
- JSON: SGLang's `{"lora_name": ..., "lora_path": ..., "pinned": false}` or vLLM's `{"name": ..., "path": ...}`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Protocol

from srt.lora.config import LORA_BACKENDS, LORA_TARGET_MODULES

# What a client may write as an adapter name (a model name in OpenAI's `model`): no ":" (BASE:ADAPTER
# separates the two), no whitespace or control characters, at most this long.
MAX_ADAPTER_NAME_CHARS = 256
ADAPTER_NAME = re.compile(r"[^\s:]+")


class LoRAFlags(Protocol):
    """The LoRA flags of `ServerArgs` (this module is below it)."""

    enable_lora: bool
    lora_paths: list[str] | None
    lora_modules: list[str] | None
    max_loras_per_batch: int
    max_loras: int | None
    max_loaded_loras: int | None
    max_lora_rank: int | None
    lora_target_modules: list[str] | None
    lora_backend: str


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    pinned: bool = False


def check_adapter_name(name: object) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if not isinstance(name, str) or not name:
        return "an adapter name must be a non-empty string"
    if len(name) > MAX_ADAPTER_NAME_CHARS:
        return f"an adapter name has at most {MAX_ADAPTER_NAME_CHARS} characters"
    if not ADAPTER_NAME.fullmatch(name):
        return f"adapter name {name!r} may not contain ':' or whitespace"
    return None


def parse_adapter_spec(entry: str, flag: str) -> AdapterSpec:
    """One entry of `flag`; ValueError naming the flag and the entry when it is malformed."""
    text = entry.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {entry!r}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{flag} {entry!r}: a JSON entry must be an object")
        name, path = obj.get("lora_name", obj.get("name")), obj.get("lora_path", obj.get("path"))
        pinned = obj.get("pinned", False)
        unknown = sorted(set(obj) - {"lora_name", "name", "lora_path", "path", "pinned", "base_model_name"})
        if unknown:
            raise ValueError(f"{flag} {entry!r}: unknown keys {unknown}")
        if not isinstance(pinned, bool):
            raise ValueError(f"{flag} {entry!r}: pinned must be true or false")
    elif "=" in text:
        name, path = text.split("=", 1)
        pinned = False
    else:
        name = path = text
        pinned = False
    if not isinstance(path, str) or not path:
        raise ValueError(f"{flag} {entry!r}: no adapter path")
    problem = check_adapter_name(name)
    if problem is not None:
        raise ValueError(f"{flag} {entry!r}: {problem}")
    return AdapterSpec(name, path, pinned)


def startup_adapters(lora_paths: list[str] | None, lora_modules: list[str] | None) -> list[AdapterSpec]:
    """Every adapter of both flags, in order; ValueError for a malformed entry or a name given twice."""
    specs = [parse_adapter_spec(e, "--lora-paths") for e in lora_paths or []]
    specs += [parse_adapter_spec(e, "--lora-modules") for e in lora_modules or []]
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"LoRA adapter name {spec.name!r} is given twice")
        seen.add(spec.name)
    return specs


def lora_enabled(args: LoRAFlags) -> bool:
    return bool(args.enable_lora or args.lora_paths or args.lora_modules)


def lora_flag_problems(args: LoRAFlags) -> list[str]:
    """The LoRA flags' problems, each one line (start-up refuses them, exit 2)."""
    problems = []
    try:
        specs = startup_adapters(args.lora_paths, args.lora_modules)
    except ValueError as e:
        return [str(e)]
    problems.extend(
        f"LoRA adapter {s.name!r}: {s.path!r} does not exist" for s in specs if not os.path.exists(s.path)
    )
    for flag, value in (
        ("--max-loras-per-batch", args.max_loras_per_batch),
        ("--max-loras", args.max_loras),
        ("--max-loaded-loras", args.max_loaded_loras),
        ("--max-lora-rank", args.max_lora_rank),
    ):
        if value is not None and (type(value) is not int or value < 1):
            problems.append(f"{flag} must be an integer >= 1, got {value!r}")
    modules = args.lora_target_modules or []
    unknown = sorted(set(modules) - set(LORA_TARGET_MODULES) - {"all"})
    if unknown:
        problems.append(
            f"--lora-target-modules: {unknown} are not among {', '.join(LORA_TARGET_MODULES)} or all"
        )
    if args.lora_backend not in LORA_BACKENDS:
        problems.append(
            f"--lora-backend {args.lora_backend!r}: srt runs adapters with {', '.join(LORA_BACKENDS)} only"
        )
    loaded = args.max_loaded_loras
    if loaded is not None and type(loaded) is int and len(specs) > loaded:
        problems.append(f"{len(specs)} start-up adapters exceed --max-loaded-loras {loaded}")
    return problems


def target_modules(args: LoRAFlags) -> tuple[str, ...]:
    modules = args.lora_target_modules
    if not modules or "all" in modules:
        return LORA_TARGET_MODULES
    return tuple(m for m in LORA_TARGET_MODULES if m in modules)


def slots_per_batch(args: LoRAFlags) -> int:
    """--max-loras (vLLM) wins over --max-loras-per-batch (SGLang) when given."""
    return args.max_loras if args.max_loras is not None else args.max_loras_per_batch
