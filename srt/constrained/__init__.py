"""Structured output: grammar backends behind one interface (`base_backend.py`), chosen by `--grammar-backend`.

The registry maps a backend's name to where it lives; a backend's library is imported only when the backend
is created or asked to validate, so importing this package (the CLI does) costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

from srt.constrained.base_backend import GRAMMAR_KINDS, GrammarBackend, GrammarError, GrammarKey

# name -> "module:Class"; "none" disables structured output (constrained requests get a 400).
_REGISTRY = {
    "xgrammar": "srt.constrained.xgrammar_backend:XGrammarBackend",
    "llguidance": "srt.constrained.llguidance_backend:LLGuidanceBackend",
}
NO_GRAMMAR_BACKEND = "none"
GRAMMAR_BACKENDS = (*_REGISTRY, NO_GRAMMAR_BACKEND)
# llguidance: on this CPU it compiles a JSON schema ~50x faster than xgrammar with a similar batch-64 mask cost,
# and validates without importing torch in the HTTP process (scripts/bench_grammar.py; docs/api.md, "What a request may contain").
DEFAULT_GRAMMAR_BACKEND = "llguidance"
# Seconds a constraint may take to compile with its first mask (`--grammar-compile-timeout`): llguidance
# compiles the benchmark's nested schema in ~15 ms and xgrammar in ~0.9 s on a 2-core CPU; 5 s leaves room for
# a slower machine and refuses what only a hostile constraint needs.
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 5.0


def grammar_backend_class(name: str) -> type[GrammarBackend]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def create_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
) -> GrammarBackend:
    return grammar_backend_class(name)(tokenizer, vocab_size, eos_token_ids)


def constraint_key(params: Any) -> GrammarKey | None:
    """A request's constraint: SamplingParams' `json_schema`, `regex` or `ebnf` (at most one is set)."""
    for kind in GRAMMAR_KINDS:
        spec = getattr(params, kind, None)
        if spec is not None:
            return GrammarKey(kind, spec)
    return None


__all__ = [
    "DEFAULT_GRAMMAR_BACKEND",
    "DEFAULT_GRAMMAR_COMPILE_TIMEOUT",
    "GRAMMAR_BACKENDS",
    "NO_GRAMMAR_BACKEND",
    "GrammarBackend",
    "GrammarError",
    "GrammarKey",
    "constraint_key",
    "create_grammar_backend",
    "grammar_backend_class",
]
