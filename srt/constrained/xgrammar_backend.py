"""xgrammar (SGLang's default library): grammars compiled to token-level automata with precomputed masks."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from srt.constrained.base_backend import (
    EBNF,
    JSON_SCHEMA,
    REGEX,
    GrammarBackend,
    GrammarKey,
    GrammarMatcher,
    build_by_kind,
    check_first_mask,
)

if TYPE_CHECKING:
    import torch

# The root rule an EBNF constraint must define (SGLang's and llama.cpp's GBNF convention).
EBNF_ROOT_RULE = "root"
# Mask filling is done in the scheduler process, which shares its cores with the forward pass.
MASK_THREADS = 1
# JSON without free whitespace (a model cannot spend its token budget on blank lines), compact as llguidance's.
JSON_OPTIONS = {"any_whitespace": False, "separators": (",", ":")}
ERRORS = (RuntimeError, ValueError, TypeError, json.JSONDecodeError)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.eos_token_ids
        )
        # srt's own LRU (grammar_manager.py) is the one cache, so its hit counter tells the truth.
        self._compiler = xgr.GrammarCompiler(info, max_threads=MASK_THREADS, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=MASK_THREADS)

    def compile(self, key: GrammarKey) -> Any:
        builders = {
            JSON_SCHEMA: lambda spec: self._compiler.compile_json_schema(spec, **JSON_OPTIONS),
            REGEX: self._compiler.compile_regex,
            EBNF: lambda spec: self._compiler.compile_grammar(spec, root_rule_name=EBNF_ROOT_RULE),
        }
        return build_by_kind(key, builders, ERRORS)

    def judge(self, key: GrammarKey) -> None:
        from srt.constrained.bitmask import allocate_bitmask  # torch: xgrammar imports it anyway

        matcher = self.new_matcher(self.compile(key))
        bitmask = allocate_bitmask(1, self.vocab_size)
        self.fill_bitmask([matcher], bitmask)
        check_first_mask(key, matcher, bool(bitmask.any()))

    def new_matcher(self, grammar: Any) -> GrammarMatcher:
        m = self._xgr.GrammarMatcher(grammar)
        return GrammarMatcher(m, m.accept_token, m.is_terminated)

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].matcher.fill_next_token_bitmask(bitmask, 0)
            return
        self._batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask)
