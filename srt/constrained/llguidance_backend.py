"""llguidance (Microsoft's guidance engine): an Earley parser over a lexer, masks computed lazily per token.
It imports no torch, so the grammar judge (`judge.py`) runs it in a light process.

Its `LLParserLimits` defaults are the per-mask budget: at most 200,000 units of lexer fuel (~14 ms) and
50,000 Earley items (~2.5 ms) per token mask, 250,000 lexer states and 500,000 grammar symbols in all. A mask
past one of them is flagged (`GrammarMatcher.error`), never silently wrong: the judge refuses a constraint
whose first mask is, and the scheduler ends a request whose later mask is."""

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
    check_first_mask,
)

if TYPE_CHECKING:
    import torch

# JSON without free whitespace: a model cannot spend its token budget on blank lines.
JSON_DEFAULTS = {"whitespace_flexible": False}
ERRORS = (ValueError, TypeError, json.JSONDecodeError)
BYTES_PER_WORD = 4
# Tokens the judge walks through a grammar before calling it enforceable (see `judge`).
JUDGE_STEPS = 16


def _lowest_allowed(mask: bytes, stop: set[int], vocab_size: int) -> int | None:
    """The lowest token id a bitmask (bytes, bit j of byte b allows token 8b + j) allows, stop tokens aside."""
    for b, byte in enumerate(mask):
        if byte:
            for j in range(8):
                token = 8 * b + j
                if byte >> j & 1 and token not in stop and token < vocab_size:
                    return token
    return None


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

    def compile(self, key: GrammarKey) -> Any:
        """A prototype matcher (the grammar parsed against this tokenizer); requests get deep copies."""
        matcher = self._ll.LLMatcher(self._tokenizer, _grammar_text(key))
        if matcher.is_error():
            raise GrammarError(f"the {key.kind} does not compile: {matcher.get_error()}", key.kind)
        return matcher

    def judge(self, key: GrammarKey) -> None:
        """As the base class's, with the mask as bytes (the judge's process never imports torch), and then a
        walk of up to JUDGE_STEPS tokens (each time the lowest allowed one that is not a stop token): masks
        are computed lazily here, and a lexer that explodes (`(x{1000}){1000}`) does so on the first tokens,
        where a 400 is still possible."""
        matcher = self.new_matcher(self.compile(key))
        stop = set(self.eos_token_ids)
        for _ in range(JUDGE_STEPS):
            mask = matcher.matcher.compute_bitmask()
            check_first_mask(key, matcher, any(mask))
            token = _lowest_allowed(mask, stop, self.vocab_size)
            if token is None:
                return  # only a stop token may follow: the grammar can end here
            if not matcher.accept_token(token) or matcher.error():
                detail = matcher.error().strip().removeprefix("Warning: ").splitlines()
                raise GrammarError(
                    f"the {key.kind} exceeds the grammar library's limits"
                    + (f": {detail[0]}" if detail else " within its first tokens"),
                    key.kind,
                )
            if matcher.is_terminated():
                return

    def new_matcher(self, grammar: Any) -> GrammarMatcher:
        m = grammar.deep_copy()
        return GrammarMatcher(m, m.consume_token, m.is_stopped, m.get_error)

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """All rows in one call: llguidance spreads them over its own thread pool."""
        self._executor.unsafe_compute_mask_ptr(
            [(m.matcher, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            bitmask.shape[1] * BYTES_PER_WORD,
            len(matchers),
        )
