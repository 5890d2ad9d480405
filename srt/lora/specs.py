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
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from srt.lora.config import LORA_BACKENDS, LORA_TARGET_MODULES

# What a client may write as an adapter name (a model name in OpenAI's `model`, a label of the LoRA metrics):
# at most this long, and none of the characters below.
MAX_ADAPTER_NAME_CHARS = 256
# ":" separates BASE:ADAPTER; "," separates the adapters of one metric label (running_lora_adapters)
NAME_SEPARATORS = ":,"
# Unicode's Default_Ignorable_Code_Point ranges (DerivedCoreProperties.txt): characters a renderer shows as
# nothing. Most are category Cf, which the name rule refuses anyway; these few are not (a Hangul filler is
# a letter, variation selectors are marks) and would let two names that look the same differ.
INVISIBLE_RANGES = (
    (0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F), (0x3164, 0x3164),
    (0xFE00, 0xFE0F), (0xFFA0, 0xFFA0), (0x1D173, 0x1D17A), (0xE0100, 0xE01EF),
)  # fmt: skip
# The most characters of a caller's value (a name, a path, a config field) that an adapter error repeats: a
# 5 KB `peft_type` must not come back whole in a 400.
MAX_ECHO_CHARS = 120


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
    lora_allowed_dirs: list[str] | None


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    pinned: bool = False


def echo(value: object) -> str:
    """`value` as an error message repeats it: its repr with every non-ASCII character escaped (an invisible
    or right-to-left character shows as its code), at most MAX_ECHO_CHARS characters of it."""
    text = ascii(value)
    if len(text) <= MAX_ECHO_CHARS:
        return text
    return f"{text[:MAX_ECHO_CHARS]}... ({len(text)} characters)"


def _unfit_char(ch: str) -> bool:
    """Whitespace, a separator, or a character that prints as nothing or as something else: any of Unicode's
    "other" categories (C*: control, format, surrogate, private use, unassigned) or an invisible one."""
    if ch.isspace() or ch in NAME_SEPARATORS or unicodedata.category(ch).startswith("C"):
        return True
    code = ord(ch)
    return any(low <= code <= high for low, high in INVISIBLE_RANGES)


def check_adapter_name(name: object, taken: Iterable[str] = ()) -> str | None:
    """Why `name` cannot name an adapter, or None. One rule for the start-up flags and runtime loads, since
    a name ends up in `model`, in logs and in metric labels: no whitespace, ':' or ',', no control,
    format or invisible character (in the name or in its NFKC form), and not a name that differs from one
    of `taken` (the names already served) only by Unicode normalization. `taken` holding `name` itself is
    the caller's "already loaded"."""
    if not isinstance(name, str) or not name:
        return "an adapter name must be a non-empty string"
    if len(name) > MAX_ADAPTER_NAME_CHARS:
        return f"an adapter name has at most {MAX_ADAPTER_NAME_CHARS} characters"
    folded = unicodedata.normalize("NFKC", name)
    if any(_unfit_char(ch) for ch in name + folded):
        return (
            f"adapter name {echo(name)} may not contain ':', ',', whitespace, or control, format or "
            "invisible characters"
        )
    twin = next((t for t in taken if t != name and unicodedata.normalize("NFKC", t) == folded), None)
    if twin is not None:
        return f"adapter name {echo(name)} differs from {echo(twin)} only by Unicode normalization (NFKC)"
    return None


def parse_adapter_spec(entry: str, flag: str) -> AdapterSpec:
    """One entry of `flag`; ValueError naming the flag and the entry when it is malformed."""
    text = entry.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {echo(entry)}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{flag} {echo(entry)}: a JSON entry must be an object")
        name, path = obj.get("lora_name", obj.get("name")), obj.get("lora_path", obj.get("path"))
        pinned = obj.get("pinned", False)
        unknown = sorted(set(obj) - {"lora_name", "name", "lora_path", "path", "pinned", "base_model_name"})
        if unknown:
            raise ValueError(f"{flag} {echo(entry)}: unknown keys {echo(unknown)}")
        if not isinstance(pinned, bool):
            raise ValueError(f"{flag} {echo(entry)}: pinned must be true or false")
    elif "=" in text:
        name, path = text.split("=", 1)
        pinned = False
    else:
        name = path = text
        pinned = False
    if not isinstance(path, str) or not path:
        raise ValueError(f"{flag} {echo(entry)}: no adapter path")
    return AdapterSpec(name, path, pinned)


def startup_adapters(lora_paths: list[str] | None, lora_modules: list[str] | None) -> list[AdapterSpec]:
    """Every adapter of both flags, in order; ValueError for a malformed entry, a name the name rule
    refuses (`check_adapter_name`, against the names before it) or a name given twice."""
    entries = [("--lora-paths", e) for e in lora_paths or []] + [
        ("--lora-modules", e) for e in lora_modules or []
    ]
    specs: list[AdapterSpec] = []
    for flag, entry in entries:
        spec = parse_adapter_spec(entry, flag)
        taken = [s.name for s in specs]
        if spec.name in taken:
            raise ValueError(f"LoRA adapter name {echo(spec.name)} is given twice")
        problem = check_adapter_name(spec.name, taken)
        if problem is not None:
            raise ValueError(f"{flag} {echo(entry)}: {problem}")
        specs.append(spec)
    return specs


def allowed_adapter_dirs(args: LoRAFlags) -> tuple[str, ...]:
    """The directories `/load_lora_adapter` may read adapters under, resolved (realpath): --lora-allowed-dirs,
    else the parent directories of the start-up adapters (empty: no runtime load of a path at all)."""
    if args.lora_allowed_dirs is not None:
        dirs = args.lora_allowed_dirs
    else:
        specs = startup_adapters(args.lora_paths, args.lora_modules)
        dirs = [os.path.dirname(os.path.realpath(s.path)) for s in specs]
    return tuple(dict.fromkeys(os.path.realpath(d) for d in dirs))


def confine_adapter_path(path: str, allowed: tuple[str, ...]) -> str | None:
    """`path` resolved (symlinks and `..` followed), if it is a directory at or under one of `allowed`; None
    otherwise. A missing path and a forbidden one both give None: the caller answers both alike, so the
    answer tells nothing about the server's file system outside the allowed directories."""
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in allowed):
        return None
    return real if os.path.isdir(real) else None


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
    problems.extend(
        f"--lora-allowed-dirs {echo(d)} is not a directory"
        for d in args.lora_allowed_dirs or []
        if not os.path.isdir(d)
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
