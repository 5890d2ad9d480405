"""The one definition of a valid request value, shared by the OpenAI and the native request models.

Every route parses its body into a `StrictModel`: a key no field has, in any object of the body, is refused
by name (`StrictModel`'s one rule); an int field takes no bool, str or float; a float takes an
int but no bool, str, NaN or infinity; a bool takes only true/false; every string anywhere in the body must be
encodable as UTF-8 (a JSON `"\\ud800"` escape decodes to a lone surrogate that the tokenizer, the detokenizer
and `json.dumps` of a response would all choke on). Numbers have 64-bit (or narrower) ranges and lists have
documented maxima, so nothing a child process receives can overflow a C integer or grow without bound.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from srt.sampling.sampling_params import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_ENTRIES

# ---- limits (docs/api.md, "What a request may contain", lists them for users) ----
# Samples per prompt (`n`): bounds the work one HTTP request can queue.
MAX_N = 64
# Prompts in one request (a list of prompts, or of token-id lists).
MAX_PROMPTS = 64
# Internal requests one HTTP request may create (prompts x n).
MAX_SEQUENCES = 256
# OpenAI allows at most 20 top logprobs per token.
MAX_TOP_LOGPROBS = 20
# Stop strings are matched by the detokenizer after every token, each against the text's tail: bound the
# count and the length so one request cannot make that quadratic work large.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# Chat messages in one request (their text is bounded by the context length separately).
MAX_MESSAGES = 1024
# Client-chosen request ids: printable, short enough for a log line and a metric-free label.
MAX_RID_CHARS = 256
# Token ids are checked against the vocabulary later; this bound only keeps them inside a C int.
MAX_TOKEN_ID = 2**31 - 1
# Counts (max_tokens, top_k, ...) never need more than a C int.
MAX_COUNT = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class FieldError(ValueError):
    """A validation failure that knows the field it belongs to (pydantic keeps the exception, and the HTTP
    layer reports `param` from it where pydantic's own location is only the body)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


_TEXT_OR_CONTAINER = frozenset({str, list, dict})


def _first_surrogate_path(value: Any, path: str) -> str | None:
    """The dotted path of the first string under `value` that is not valid UTF-8 text, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        if not _TEXT_OR_CONTAINER.intersection(map(type, value)):
            return None  # numbers only (token ids): skipped at C speed
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _first_surrogate_path(key, path) is not None:
            return path or "body"
        found = _first_surrogate_path(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class RefusedKey(FieldError):
    """A key an object may not have (unknown, or a feature srt lacks); `param` is the key, which the HTTP
    layer prefixes with the object's path."""


@cache
def _known_keys(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(f.alias or name for name, f in model.model_fields.items())


class StrictModel(BaseModel):
    """Strict types and finite floats, and srt's one rule for keys: an unknown one is a 400 naming it, at
    every level of every body (the README's promise). A client's typo or a parameter of another route or
    server never does silently nothing.

    `refused` names parameters of features srt lacks: null is accepted as "not used", any other value is a
    400 with the reason. `route` is what the message calls a whole body ("/generate"); a nested object has
    none. The check runs in Python once per object, which also lets a body parsed on a worker thread hand
    the GIL back between objects (srt/http_server/body_parsing.py)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    route: ClassVar[str] = ""
    refused: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = _known_keys(cls)
        extra = [k for k in data if k not in known]
        if not extra:
            return data
        for name in extra:
            if name not in cls.refused:
                where = f"a parameter of {cls.route}" if cls.route else "a field of this object"
                raise RefusedKey(
                    f"`{name}` is not {where}: srt refuses what it does not know rather than ignore it",
                    str(name),
                )
            if data[name] is not None:
                raise RefusedKey(f"`{name}` is not supported: {cls.refused[name]}", name)
        return {k: v for k, v in data.items() if k not in cls.refused}


class RequestBody(StrictModel):
    """A whole request body: also rejects lone surrogates anywhere in it, naming where."""

    @model_validator(mode="before")
    @classmethod
    def _utf8_text_only(cls, data: Any) -> Any:
        path = _first_surrogate_path(data, "")
        if path is not None:
            raise FieldError(
                f"`{path}` contains a lone UTF-16 surrogate, which is not valid Unicode text", path
            )
        return data


# ---- value types ----
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
PositiveCount = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
NumSamples = Annotated[int, Field(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Temperature = Annotated[float, Field(ge=0.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0)]


def _check_top_k(k: int) -> int:
    if k != -1 and k < 1:
        raise ValueError("must be -1 (disabled) or >= 1")
    return k


TopK = Annotated[int, Field(ge=-1, le=MAX_COUNT), AfterValidator(_check_top_k)]


def _check_rid(rid: str) -> str:
    if not 1 <= len(rid) <= MAX_RID_CHARS or not rid.isprintable():
        raise ValueError(f"must be 1 to {MAX_RID_CHARS} printable characters")
    return rid


Rid = Annotated[str, AfterValidator(_check_rid)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]


def _stop_strings(value: Any) -> list[str]:
    """`stop`: a string or a list of strings, at most MAX_STOP_STRINGS of at most MAX_STOP_STRING_CHARS."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise ValueError(f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters")
    return [s for s in stops if s]


StopStrings = Annotated[list[str], BeforeValidator(_stop_strings)]


def _logit_bias(value: Any) -> dict[int, float] | None:
    """`logit_bias`: a JSON object from token ids (keys are strings of integers, as OpenAI sends them) to
    biases in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT], at most MAX_LOGIT_BIAS_ENTRIES entries. Ids are checked
    against the vocabulary by the TokenizerManager."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit() or len(key) > 10:
            raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        if type(bias) not in (int, float) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(
                f"biases must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias!r} "
                f"for token {key}"
            )
        out[int(key)] = float(bias)
    if any(k > MAX_TOKEN_ID for k in out):
        raise ValueError("token id out of range")
    return out


LogitBias = Annotated[dict[int, float] | None, BeforeValidator(_logit_bias)]


def prompt_list(value: Any, name: str, text: bool = True, ids: bool = True) -> list[str | list[int]]:
    """A prompt in any of OpenAI's forms — text, token ids, a list of texts, a list of token-id lists — as a
    non-empty list of at most MAX_PROMPTS prompts; token ids are ints in [0, MAX_TOKEN_ID]. `text`/`ids`
    say which forms the field takes."""

    def token_ids(seq: list) -> list[int]:
        if not seq:
            raise ValueError("a token-id list must not be empty")
        kinds = set(map(type, seq))  # C-speed passes: a prompt may hold a million ids
        if kinds != {int}:
            bad = next(k for k in kinds if k is not int)
            raise ValueError(f"token ids must be integers, got {bad.__name__}")
        lo, hi = min(seq), max(seq)
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise ValueError(f"token id {lo if lo < 0 else hi} is out of range")
        return seq

    forms = " or ".join(
        f
        for f, ok in (("a string or a list of strings", text), ("token ids or lists of token ids", ids))
        if ok
    )
    if text and isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"`{name}` must be {forms} (non-empty)")
    if text and all(isinstance(x, str) for x in value):
        prompts: list = list(value)
    elif ids and type(value[0]) is int:
        prompts = [token_ids(value)]
    elif ids and all(isinstance(x, list) for x in value):
        prompts = [token_ids(x) for x in value]
    else:
        raise ValueError(f"`{name}` must be {forms}, not a mixture")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    return prompts


# SGLang's native prompt fields (`/generate`, `/encode`): one or several texts, or token-id lists; absent
# allowed (the body says which of the two it carries)
NativeTexts = Annotated[
    list[str] | None, BeforeValidator(lambda v: v if v is None else prompt_list(v, "text", ids=False))
]
NativeInputIds = Annotated[
    list | None, BeforeValidator(lambda v: v if v is None else prompt_list(v, "input_ids", text=False))
]
