"""The grammar backend interface: what the scheduler needs from a structured-output library.

A constraint is a `GrammarKey` — a kind (`json_schema`, `regex`, `ebnf`) and its text — and is the cache key
of its compiled grammar. The contract every backend keeps:

- `judge(key)` compiles the constraint and computes its first mask, raising `GrammarError` for anything
  that would fail a request later. The HTTP process's grammar judge (`judge.py`) calls it, in a child
  process, so a bad constraint is a 400 naming its field; the scheduler never sees one that fails it.
- `compile(key)` builds the tokenizer-specific grammar; it may take long (hundreds of ms) and is called from a
  worker thread, never from the scheduler loop. It raises `GrammarError` on failure. The result is immutable
  and shared by every request with the same key.
- `new_matcher(grammar)` returns a fresh per-request matcher (cheap). A matcher is touched by one thread at a
  time: the worker creates it, then only the scheduler loop uses it.
- `fill_bitmask(matchers, bitmask)` writes matcher i's allowed-token bitmask into row i of `bitmask`
  (int32, `bitmask.allocate_bitmask(n, vocab_size)`; bit j of word w allows token 32*w + j). EOS is allowed exactly where the
  grammar may end.
- `GrammarMatcher.accept_token(t)` advances past a sampled token and returns False if the grammar rejects it;
  `is_terminated()` is True once nothing but the end can follow (llguidance says so at once, xgrammar after
  accepting the stop token): the scheduler then finishes the request with `stop`. `error()` is the
  library's complaint ('' when none): a mask computed past one of its limits, or a grammar found
  unsatisfiable while matching. A mask with an error is not to be trusted (llguidance then allows only the
  stop token, which would end the request as a "complete" empty match), so the scheduler fails the request.

Tools' `tool_choice="required"` or a named function are a JSON schema over the call's arguments (an `anyOf`
of the tools' `{"name": const, "arguments": schema}` objects): they compile through the same `json_schema`
kind and need nothing more from a backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

JSON_SCHEMA, REGEX, EBNF = "json_schema", "regex", "ebnf"
GRAMMAR_KINDS = (JSON_SCHEMA, REGEX, EBNF)
# response_format {"type": "json_object"}: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
BITS_PER_WORD = 32
# llguidance's stop reason (NoExtension, NoExtensionBias) when no token can continue the grammar.
NO_EXTENSION = "NoExtension"


class GrammarKey(NamedTuple):
    kind: str
    spec: str


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `kind` says which constraint field was at fault."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


class GrammarMatcher:
    """One request's position in its grammar: a library's matcher and its two operations under srt's names."""

    __slots__ = ("matcher", "accept_token", "is_terminated", "error", "key")

    def __init__(
        self,
        matcher: Any,
        accept_token: Callable[[int], bool],
        is_terminated: Callable[[], bool],
        error: Callable[[], str] = lambda: "",
    ):
        self.matcher = matcher
        self.accept_token = accept_token
        self.is_terminated = is_terminated
        self.error = error
        self.key: GrammarKey | None = None  # the constraint it matches (set by the grammar manager)


def build_by_kind(key: GrammarKey, builders: dict[str, Callable[[str], Any]], errors: tuple) -> Any:
    """`builders[key.kind](key.spec)`, with the library's `errors` (and an unknown kind) as `GrammarError`."""
    builder = builders.get(key.kind)
    if builder is None:
        raise GrammarError(f"unknown constraint kind {key.kind!r}", key.kind)
    try:
        return builder(key.spec)
    except errors as e:
        raise GrammarError(f"the {key.kind} does not compile: {e}", key.kind) from e


def check_first_mask(key: GrammarKey, matcher: GrammarMatcher, any_allowed: bool) -> None:
    error = matcher.error().strip().removeprefix("Warning: ")
    if error.startswith(NO_EXTENSION):
        raise GrammarError(f"the {key.kind} admits no output (no first token can start a match)", key.kind)
    if error:
        raise GrammarError(f"the {key.kind} cannot be enforced: {error}", key.kind)
    if not any_allowed:
        raise GrammarError(f"the {key.kind} admits no output", key.kind)


class GrammarBackend(ABC):
    """A structured-output library bound to one tokenizer (see the module docstring for the contract)."""

    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @abstractmethod
    def compile(self, key: GrammarKey) -> Any: ...

    @abstractmethod
    def new_matcher(self, grammar: Any) -> GrammarMatcher: ...

    @abstractmethod
    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None: ...

    @abstractmethod
    def judge(self, key: GrammarKey) -> None:
        """Compile `key` and compute its first mask as a request would, raising GrammarError where the library
        reports a problem (a limit hit, an unsatisfiable schema) or the mask allows no token at all
        (`check_first_mask`). Runs in the grammar judge's process, which imports torch only if the
        backend's library does."""
