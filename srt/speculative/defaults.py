"""The speculative flags' defaults (SGLang's, except two measured on the CPU, below), in a module that imports nothing: `ServerArgs` reads it in
the HTTP process, which must not import torch.

SGLang counts the verified root in `--speculative-num-draft-tokens`: a verify step feeds the last accepted
token plus the drafts, so a chain of `num_draft_tokens` positions proposes `num_draft_tokens - 1` drafts.
"""

# --per-request-spec-decode-metrics' choices (vLLM's; its `detailed` adds per-step lists srt does not keep)
PER_REQUEST_SPEC_METRICS = ("summary",)
# --speculative-algorithm's choices (SGLang's names)
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
# the algorithm whose drafts come from a second model (--speculative-draft-model-path)
DRAFT_MODEL_ALGORITHM = "STANDALONE"
# --speculative-ngram-min-match-window-size: shortest suffix that may anchor a lookup. SGLang's is 1; srt's 3,
# measured (scripts/bench_spec.py, batch 1, 2-core AMD EPYC Zen 4, docs/benchmarks): a single matching token
# drafts mostly rejected tokens in open chat (0.51x of no speculation at 1 and 11 drafts; 0.94x at 3 and 4).
NGRAM_MIN_MATCH_WINDOW_SIZE = 3
# --speculative-ngram-max-match-window-size: longest suffix compared (SGLang: 12).
NGRAM_MAX_MATCH_WINDOW_SIZE = 12
# --speculative-num-draft-tokens when unset: 5 positions (4 drafts). SGLang falls back to the max match window
# (12: 11 drafts); on the CPU a verify step's cost grows with the tokens it feeds through the extend path, and
# 11 drafts made grounded batch-1 decoding slower than none (0.92x) where 4 made it faster (1.39x).
NUM_DRAFT_TOKENS = 5


# A verify step feeds each drafting request its newest token and its drafts, through the extend path; on the
# CPU a step's cost grows with the tokens it feeds once they are more than a few dozen, while a decode step of
# the same batch costs one token per request. So the drafts per request shrink as the batch grows, to keep a
# verify step within this many fed tokens: all 11 drafts up to a batch of 5, 3 at 16, 1 at 32, none from 64
# (speculation steps aside, the batch decodes plainly). A first estimate for a 2-core CPU, to be measured.
VERIFY_STEP_TOKENS = 64


# Drafts a request with OpenAI's `prediction` may take per verify step (the batch-size rule below applies too):
# its drafts are the client's own text, accepted far more often than n-gram guesses, and 7 drafts + the newest
# token are the most rows the fused CPU verify step takes at once.
PREDICTION_DRAFTS_PER_STEP = 7


def most_drafts_per_step(drafts_per_step: int) -> int:
    """The most drafts any request takes in one step: the algorithm's, or a prediction's."""
    return max(drafts_per_step, PREDICTION_DRAFTS_PER_STEP)


def drafts_for_batch(k: int, batch_size: int, step_tokens: int = VERIFY_STEP_TOKENS) -> int:
    """Drafts each request may take in a decode step of `batch_size` requests: `k`, fewer once the step's
    fed tokens would pass `step_tokens`, 0 when even one draft each would (vLLM's rule turns speculation
    off past a batch size; this one shrinks it first)."""
    if batch_size <= 0:
        return k
    return max(min(k, step_tokens // batch_size - 1), 0)


def drafts_per_step(num_draft_tokens: int) -> int:
    """Draft tokens a verify step may propose per request under SGLang's counting (the root is not a draft)."""
    return max(num_draft_tokens - 1, 0)
