"""llguidance (Microsoft's guidance engine): an Earley parser over a lexer, masks computed lazily per token.
It imports no torch, so the HTTP process can validate constraints with it cheaply."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from srt.constrained.base_backend import (
    EBNF,
    JSON_SCHEMA,
    REGEX,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    GrammarMatcher,
    build_by_kind,
)

if TYPE_CHECKING:
    import torch

# JSON without free whitespace: a model cannot spend its token budget on blank lines.
JSON_DEFAULTS = {"whitespace_flexible": False}
ERRORS = (ValueError, TypeError, json.JSONDecodeError)
BYTES_PER_WORD = 4


def _grammar_text(key: GrammarKey) -> str:
    """llguidance's grammar definition of a constraint (parsing happens when a matcher is built)."""
    from llguidance import LLMatcher, grammar_from

    builders = {
        JSON_SCHEMA: lambda spec: LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS),
        REGEX: LLMatcher.grammar_from_regex,
        EBNF: lambda spec: grammar_from("gbnf", spec),
    }
    return build_by_kind(key, builders, ERRORS)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._executor = llguidance.LLExecutor()

    @classmethod
    def validate(cls, key: GrammarKey) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(_grammar_text(key))
        if error:
            raise GrammarError(f"the {key.kind} does not compile: {error}", key.kind)

    def compile(self, key: GrammarKey) -> Any:
        """A prototype matcher (the grammar parsed against this tokenizer); requests get deep copies."""
        matcher = self._ll.LLMatcher(self._tokenizer, _grammar_text(key))
        if matcher.is_error():
            raise GrammarError(f"the {key.kind} does not compile: {matcher.get_error()}", key.kind)
        return matcher

    def new_matcher(self, grammar: Any) -> GrammarMatcher:
        m = grammar.deep_copy()
        return GrammarMatcher(m, m.consume_token, m.is_stopped)

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """All rows in one call: llguidance spreads them over its own thread pool."""
        self._executor.unsafe_compute_mask_ptr(
            [(m.matcher, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            bitmask.shape[1] * BYTES_PER_WORD,
            len(matchers),
        )
