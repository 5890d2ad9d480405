"""The speculative flags' defaults, SGLang's values, in a module that imports nothing: `ServerArgs` reads it in
the HTTP process, which must not import torch.

SGLang counts the verified root in `--speculative-num-draft-tokens`: a verify step feeds the last accepted
token plus the drafts, so a chain of `num_draft_tokens` positions proposes `num_draft_tokens - 1` drafts.
"""

# --speculative-algorithm's choices (SGLang's names)
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
# the algorithm whose drafts come from a second model (--speculative-draft-model-path)
DRAFT_MODEL_ALGORITHM = "STANDALONE"
# --speculative-ngram-min-match-window-size: shortest suffix that may anchor a lookup (SGLang: 1).
NGRAM_MIN_MATCH_WINDOW_SIZE = 1
# --speculative-ngram-max-match-window-size: longest suffix compared (SGLang: 12).
NGRAM_MAX_MATCH_WINDOW_SIZE = 12
# --speculative-num-draft-tokens: SGLang leaves it unset and, for NGRAM, falls back to the max match window.
NUM_DRAFT_TOKENS = NGRAM_MAX_MATCH_WINDOW_SIZE


def drafts_per_step(num_draft_tokens: int) -> int:
    """Draft tokens a verify step may propose per request under SGLang's counting (the root is not a draft)."""
    return max(num_draft_tokens - 1, 0)
