"""The speculative flags' defaults (SGLang's, except those measured on the CPU, below), in a module that imports nothing: `ServerArgs` reads it in
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
# --speculative-ngram-min-match-window-size: shortest suffix that may anchor a lookup. SGLang's is 1; srt's 2.
# With 8 drafts whatever the match, 1 token measured 129 / 133 grounded / open output tok/s against 176 / 142
# for 2 (scripts/bench_spec.py, batch 1, 2-core AMD EPYC Zen 4). Under the short-match rule below a 1-token
# match drafts only SHORT_MATCH_DRAFTS and replays a little better at batch 1 (scripts/spec_replay.py: 1.98x /
# 1.35x of no speculation against 1.95x / 1.34x), but with it concurrency 16 ran at 0.84x / 0.93x of no
# speculation in two rounds (its requests draft on single-token matches while the batch drains): 2 stays.
NGRAM_MIN_MATCH_WINDOW_SIZE = 2
# --speculative-ngram-max-match-window-size: longest suffix compared (SGLang: 12).
NGRAM_MAX_MATCH_WINDOW_SIZE = 12
# --speculative-num-draft-tokens when unset: 9 positions (8 drafts). SGLang falls back to the max match window
# (12: 11 drafts). Measured as above at a 2-token window, grounded output tok/s: 4 drafts 141, 8 drafts 176,
# 12 drafts 165 (a verify row costs ~0.6 ms on a ~7.5 ms step, see GPU_VERIFY_STEP_TOKENS).
NUM_DRAFT_TOKENS = 9


# A verify step feeds each drafting request its newest token and its drafts; the drafts per request shrink as
# the batch grows to keep a step within a budget of fed tokens (`drafts_for_batch`; speculation steps aside,
# the batch decodes plainly, once even one draft each would pass it). On the CPU the budget is what the fused
# decode step takes (`spec_step.verify_step_tokens`); on a GPU this, capped at the largest decode graph, whose
# replay the verify rows take: there a decode step of SmolLM2's shape cost 2.8 ms at 1 row and 3.9 ms at 64
# (bf16, H200, scripts/bench_model_forward.py --verify-table). From step costs only: acceptance with real
# weights has not been measured on a GPU.
GPU_VERIFY_STEP_TOKENS = 64


# Drafts a request with OpenAI's `prediction` may take per verify step (the batch-size rule above applies too):
# its drafts are the client's own text, accepted far more often than n-gram guesses. 15 drafts measured the
# same as 7 on the grounded workload (150 against 152 output tok/s, acceptance length 9.1 against 6.1): the
# steps that cost are those where the output has left the prediction, not the drafts' length.
PREDICTION_DRAFTS_PER_STEP = 7
# The shortest tail of the output that realigns a prediction after an edit (its own, not the NGRAM flag's): a
# 2-token tail measured slower (124 against 150 output tok/s): it realigns wrongly after edits, and each
# wrong alignment costs a verify step of rejected drafts. A prediction drafts its k whatever the match's
# length: the short-match rule below replayed better for it (1.71x against 1.60x with a 1-token tail), but
# on the server 16 grounded prompts ran at 114 output tok/s with it against 122 without (a 4-row verify step
# cost 1.28x a decode step there, not the 1.17x of the runner alone; 2-core AMD EPYC Zen 4).
PREDICTION_MIN_MATCH = 3

# An NGRAM lookup whose match is shorter than SHORT_MATCH_TOKENS drafts at most SHORT_MATCH_DRAFTS tokens: a
# short match is often a coincidence, and on the CPU a verify step of up to 4 fed
# tokens costs little more than a decode step (a batch-1 SmolLM2 step after 300 tokens: 1 row 7.4 ms, 4 rows
# 8.7, 5 rows 10.0, 8 rows 12.4, 9 rows 14.0; the int8 kernel multiplies tokens 4 at a time), while every
# fed row past it costs ~1 ms. Replayed (scripts/spec_replay.py, 2-core AMD EPYC Zen 4), NGRAM with a
# 2-token window and 8 drafts, grounded / open: 1.88x / 1.26x of no speculation with 8 drafts whatever the
# match, 1.95x / 1.34x with this rule (with 3 drafts below 3 tokens instead of 4: 1.94x / 1.34x). Measured
# (scripts/bench_spec.py, 3 rounds): grounded 1.82x, open 1.47x, concurrency 16 0.98x of no speculation.
SHORT_MATCH_TOKENS = 4
SHORT_MATCH_DRAFTS = 3


def most_drafts_per_step(drafts_per_step: int) -> int:
    """The most drafts any request takes in one step: the algorithm's, or a prediction's."""
    return max(drafts_per_step, PREDICTION_DRAFTS_PER_STEP)


def drafts_for_batch(k: int, batch_size: int, step_tokens: int) -> int:
    """Drafts each request may take in a decode step of `batch_size` requests: `k`, fewer once the step's
    fed tokens would pass `step_tokens`, 0 when even one draft each would (vLLM's rule turns speculation
    off past a batch size; this one shrinks it first)."""
    if batch_size <= 0:
        return k
    return max(min(k, step_tokens // batch_size - 1), 0)


def drafts_per_step(num_draft_tokens: int) -> int:
    """Draft tokens a verify step may propose per request under SGLang's counting (the root is not a draft)."""
    return max(num_draft_tokens - 1, 0)
