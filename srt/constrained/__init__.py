"""Structured output: grammar backends behind one interface (`base_backend.py`), chosen by `--grammar-backend`.

The registry maps a backend's name to where it lives; a backend's library is imported only when the backend
is created or asked to validate, so importing this package (the CLI does) costs nothing.
"""

from __future__ import annotations

import functools
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
# and validates without importing torch in the HTTP process (scripts/bench_grammar.py; README).
DEFAULT_GRAMMAR_BACKEND = "llguidance"
# Distinct constraints whose successful validation the HTTP process remembers.
VALIDATED_CACHE_SIZE = 1024


def grammar_backend_class(name: str) -> type[GrammarBackend]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def create_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
) -> GrammarBackend:
    return grammar_backend_class(name)(tokenizer, vocab_size, eos_token_ids)


@functools.lru_cache(maxsize=VALIDATED_CACHE_SIZE)
def validate_grammar(name: str, key: GrammarKey) -> None:
    """The HTTP process's check of a constraint with the serving backend (no tokenizer), raising
    `GrammarError`; successes are remembered, so a repeated schema is checked once."""
    if name == NO_GRAMMAR_BACKEND:
        raise GrammarError("structured output is disabled on this server (--grammar-backend none)", key.kind)
    grammar_backend_class(name).validate(key)


def validate_constraint(name: str, params: Any) -> None:
    """`validate_grammar` for a request's SamplingParams (its `json_schema`, `regex` or `ebnf`, if any)."""
    for kind in GRAMMAR_KINDS:
        spec = getattr(params, kind, None)
        if spec is not None:
            validate_grammar(name, GrammarKey(kind, spec))


__all__ = [
    "DEFAULT_GRAMMAR_BACKEND",
    "GRAMMAR_BACKENDS",
    "NO_GRAMMAR_BACKEND",
    "GrammarBackend",
    "GrammarError",
    "GrammarKey",
    "create_grammar_backend",
    "grammar_backend_class",
    "validate_constraint",
    "validate_grammar",
]
