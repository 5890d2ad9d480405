"""C prototypes to typed ctypes functions: the CPU kernels' ABI is declared once, by their C sources.

Every exported (non-static) `srt_*` function defined or declared at the start of a line gets its ctypes
signature from its prototype (`parse_prototypes`), and is bound with exact arity (`bind`): an argument added
or dropped on one side is a TypeError at the call, not memory corruption.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass

# A C type missing here raises at load rather than being guessed.
C_TYPES = {
    "void": None,
    "int": ctypes.c_int,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_QUALIFIERS = frozenset(("const", "volatile", "restrict", "__restrict", "__restrict__"))
_COMMENTS = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
# an exported function's prototype starts a line (bodies are indented): return type, name, "("
_PROTOTYPE_START = re.compile(r"^[A-Za-z_][\w \t*]*?[ \t*]\b(srt_\w+)[ \t]*\(", re.M)
_NAME_AND_PAREN = re.compile(r"\b(srt_\w+)\s*\(")


@dataclass(frozen=True)
class Prototype:
    """One exported kernel's C signature as ctypes types (restype None for void)."""

    name: str
    restype: type | None
    argtypes: tuple[type, ...]


def _ctype(decl: str, prototype: str, with_name: bool) -> type | None:
    """The ctypes type of one C parameter (`with_name`: its last word is the parameter's name) or return
    type: any pointer or array is an address (c_void_p); other types must be in C_TYPES."""
    if "(" in decl:
        raise ValueError(f"{prototype}: unsupported parameter {decl.strip()!r} (function pointer?)")
    if "*" in decl or "[" in decl:
        return ctypes.c_void_p
    words = [w for w in decl.split() if w not in _QUALIFIERS]
    if with_name and len(words) > 1:
        words = words[:-1]
    name = " ".join(words)
    if name not in C_TYPES:
        raise ValueError(f"{prototype}: C type {name!r} has no ctypes mapping in c_abi.C_TYPES; add it there")
    return C_TYPES[name]


def parse_prototypes(text: str) -> dict[str, Prototype]:
    """The exported `srt_*` functions of C source text, by name. Raises ValueError on a prototype it cannot
    read, a type it cannot map, or one name declared twice with different signatures."""
    text = _COMMENTS.sub(" ", text)
    found: dict[str, Prototype] = {}
    internal = set()
    for match in _PROTOTYPE_START.finditer(text):
        ret, name = text[match.start() : match.start(1)], match.group(1)  # the return type, with any "*"
        if {"static", "ALWAYS_INLINE"} & set(ret.replace("*", " ").split()):
            internal.add(name)  # not exported: no ctypes signature
            continue
        close, depth = match.end(), 1
        while depth and close < len(text):  # the ")" that closes the parameter list
            depth += {"(": 1, ")": -1}.get(text[close], 0)
            close += 1
        if depth:
            raise ValueError(f"{name}: unterminated parameter list")
        close -= 1
        params = text[match.end() : close]
        tail = text[close + 1 :].lstrip()[:1]
        if tail not in ("{", ";"):
            raise ValueError(f"{name}: cannot read the prototype (expected '{{' or ';' after its parameters)")
        args = [p for p in (p.strip() for p in params.split(",")) if p]
        if args == ["void"]:
            args = []
        proto = Prototype(
            name, _ctype(ret, name, with_name=False), tuple(_ctype(a, name, with_name=True) for a in args)
        )
        if name in found and found[name] != proto:
            raise ValueError(f"{name}: declared twice with different signatures")
        found[name] = proto
    # a prototype this reader did not recognise (say, its return type on the line above) must not go unbound
    unread = set(_NAME_AND_PAREN.findall(text)) - set(found) - internal
    if unread:
        raise ValueError(
            f"cannot read the prototypes of {sorted(unread)}: start each line with its return type"
        )
    return found


def bind(lib: ctypes.CDLL, proto: Prototype):
    """The function `proto.name` of lib as a ctypes function typed by its prototype, which refuses a call
    with any other number of arguments (a ctypes C function allows extra ones: an argument dropped from
    the C side would shift the rest silently) or an argument its type cannot convert."""
    base = ctypes.CFUNCTYPE(None)
    # _flags_ 0 rather than CDECL: on POSIX the same call (one C calling convention), with exact arity
    flags = 0 if os.name == "posix" else base._flags_
    fn_type = type(
        proto.name, (base,), {"_argtypes_": proto.argtypes, "_restype_": proto.restype, "_flags_": flags}
    )
    return fn_type((proto.name, lib))
