"""Per-request sampling parameters, as the scheduler and the sampler see them.

The HTTP layer builds them only from values its request models validated (srt/http_server/request_types.py);
`verify` is the scheduler's own guard against a request that bypassed it, failing that request alone."""

from __future__ import annotations

from dataclasses import dataclass, field

# Context-free upper bound for max_new_tokens; the real bound is the model's context length, checked later.
DEFAULT_MAX_NEW_TOKENS = 128
# logit_bias: OpenAI's range for one bias, and the most entries one request may bias (OpenAI allows 300; a
# larger bound costs nothing: the sampler's work is one scatter over the entries).
LOGIT_BIAS_LIMIT = 100.0
# Temperatures below this are greedy (SGLang's threshold): dividing logits by a smaller one overflows float32
# (1e-40 is already denormal, 1e-300 rounds to 0) and the softmax turns into NaN, while the limit of
# sampling as the temperature falls is the argmax anyway.
GREEDY_TEMPERATURE = 1e-6
MAX_LOGIT_BIAS_ENTRIES = 1024


class SamplingParamsError(ValueError):
    """Raised for a parameter a client sent that can never be valid; the HTTP layer maps it to a 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    # Number of top log-probabilities to return per output token; None = no logprobs at all.
    logprobs: int | None = None
    # Token id -> bias added to its logit before temperature (greedy rows too); None = no bias.
    logit_bias: dict[int, float] | None = None
    # Prompt logprobs: from this prompt position on (the first prompt token has none); None = not asked.
    # Top alternatives per prompt token: `logprobs` of them.
    logprob_start_len: int | None = None
    # Structured output (SGLang's names; srt/constrained/): at most one of them, validated by the HTTP layer.
    # A JSON schema as JSON text (response_format json_object is '{"type": "object"}'), a regex, a GBNF grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def num_constraints(self) -> int:
        return sum(c is not None for c in (self.json_schema, self.regex, self.ebnf))

    def verify(self) -> None:
        """Reject values no model could honour, naming the offending field."""
        checks = [
            (self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0"),
            (0 <= self.min_new_tokens, "min_new_tokens", "must be >= 0"),
            (self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be <= max_new_tokens"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (disabled) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be between 0 and 20"),
            (_valid_logit_bias(self.logit_bias), "logit_bias", _LOGIT_BIAS_RULE),
            (
                self.logprob_start_len is None
                or (type(self.logprob_start_len) is int and self.logprob_start_len >= 0),
                "logprob_start_len",
                "must be an integer >= 0",
            ),
            (self.num_constraints <= 1, "json_schema", "must not be combined with regex or ebnf"),
        ]
        for name in ("json_schema", "regex", "ebnf"):
            if getattr(self, name) is not None and type(getattr(self, name)) is not str:
                raise SamplingParamsError(f"{name} must be a string", param=name)
        for ok, name, why in checks:
            if not ok:
                raise SamplingParamsError(f"{name} {why}, got {getattr(self, name)!r}", param=name)


_LOGIT_BIAS_RULE = (
    f"must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids (integers >= 0) to biases in "
    f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
)


def _valid_logit_bias(bias: dict[int, float] | None) -> bool:
    if bias is None:
        return True
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        return False
    return all(
        type(k) is int and k >= 0 and type(v) in (int, float) and -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT
        for k, v in bias.items()
    )
