"""How many prefill tokens a mixed step (`--enable-mixed-chunk`) may carry next to the running batch's decode.

The rule: a mixed step may take at most `MIXED_STEP_COST_MULTIPLE` times as long as a decode step of the
same running batch, or `MIXED_STEP_FLOOR_SECONDS` if that is longer, so a prompt arriving while others
decode stretches their inter-token gap by a bounded amount instead of by a whole prefill.

The scheduler feeds every forward step's time to a step-cost model t = a + b x tokens + c x keys, fitted
online: `a` (the fixed cost of a step: on a CPU, streaming the weights once) from decode steps, `b` (seconds
per token) and `c` (seconds per key a row attends to: attention, whose cost grows with the context) from
steps carrying at least `MIN_COST_SAMPLE_TOKENS` prefill tokens, by least squares over exponential moving
averages of their per-token cost and keys per token (c from the steps of at least `MIN_LONE_PREFILL_TOKENS`,
once their contexts spread: `MIN_KEY_SPREAD`; until then a chunk reaching beyond the contexts measured is
guarded, `_tokens_within`). Without c a chunk deep into a long prompt was priced at the earlier chunks' cost
per token, and steps at a 3,000-token context ran a quarter over their budget. With D decoding requests and
c = 0, the prefill budget C solves a + b (D + C) = K (a + b D):

    C = (K - 1) (a + b D) / b

and with c, the chunk's keys (C P + C (C + 1) / 2 after P tokens in KV) make it a quadratic in C.

A small running batch makes that budget small (a lean decode step of a few requests takes milliseconds on
a CPU), and a mixed step of a few dozen tokens spends most of its time on what every step costs whatever
its size. So a mixed step may also fill the floor T whatever the batch, a gap a reader of streamed text
does not notice: C = (T - a) / b - D when that is larger. The budget is clamped to
[`MIN_MIXED_PREFILL_TOKENS`, the step's other limits] (`--chunked-prefill-size` and `--max-prefill-tokens`
still cap it). Until `b` is measured, `DEFAULT_MIXED_PREFILL_TOKENS`.

A prefill step of its own (`lone_prefill_tokens`) has a larger budget, `LONE_PREFILL_STEP_SECONDS`: a step with
nothing decoding, and every step that continues a long prompt mid-chunk, decoding requests riding along. The
long prompt keeps that budget (minus the decode rows) instead of the mixed one, which is sized for the decode
step's latency: at a long context a token costs several times a short one's (attention; on a 2-core Zen 4,
0.75 ms a token at short contexts, 3.2 ms on average over a 6,300-token prompt), so a mixed budget there is a
few dozen tokens, and such a prompt crawled at 32-token steps for as long as anything decoded
(srt/scheduler/prefill_admission.py shares the step with waiting prompts).

With tensor parallelism every rank must build the same batches, and measured times differ between ranks:
there the model is not fed (`adaptive=False`) and the budget stays at the default, identical everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from srt.server_args import ServerArgs

# A mixed step may cost this many decode steps of the same running batch (the decode step included).
MIXED_STEP_COST_MULTIPLE = 4.0
# ... or this long, whichever is longer. Measured with the int8 CPU default (bench_peers, concurrency 64):
# chunks of ~33 tokens next to ~9 decoding requests gave 79-85 output tok/s, 0.3-s steps 92-123 tok/s
# (the 2-core machine's noise) with ITL p99 0.62-0.68 s; 0.4-s steps 110-129 tok/s, no clear gain within
# that noise, with ITL p99 up to 0.83 s.
MIXED_STEP_FLOOR_SECONDS = 0.3
# A prefill step of its own (nothing decoding, or a long prompt's chunk with decode rows riding along) may
# take this long (`--chunked-prefill-size` still caps it): a request arriving meanwhile waits for the step in
# flight, and on a 2-core CPU a 2,048-token chunk at the end of a 6,300-token prompt took 18 s. Short enough
# for an interactive arrival, long enough that a step's fixed cost (the weights streamed once, ~10 ms int8)
# stays ~1 % of it.
LONE_PREFILL_STEP_SECONDS = 1.0
# Its budget before the cost model has measured b (a fresh server): a 2,048-token first chunk made a request
# arriving meanwhile wait 21.7 s on a 2-core CPU. 256 tokens are 0.2-1 s at the 259-1,300 prompt tokens/s
# measured on this project's CPUs at short contexts (docs/benchmarks/), and b is measured after that step.
DEFAULT_LONE_PREFILL_TOKENS = 256
# Never fewer prefill tokens in a prefill step of its own than this, however slow its tokens look: a step's
# size-independent cost (the weights streamed once, the layers' Python, sampling: ~20 ms on the Zen 4 of
# docs/benchmarks/, far more on a contended CPU) is then a small share of it. b charges that cost to a
# step's tokens, so small steps make a token look dear and keep the budget small: on a busy 2-core CPU, after
# a few 24-token prompts, a 3,000-token prompt went in 32-token steps of about 1 s each. 128 tokens at the end
# of a 6,300-token prompt on that Zen 4 (~5 ms a token there) take ~0.7 s, within the budget.
MIN_LONE_PREFILL_TOKENS = 128
# Never fewer prefill tokens per mixed step than this: a waiting prompt always makes progress.
MIN_MIXED_PREFILL_TOKENS = 32
# The budget before the cost model has measured b (measured on this project's CPU with SmolLM2-135M fp32:
# a ~ 60 ms, b ~ 2.2 ms/token, so about (4 - 1) x 60 / 2.2 ~ 80 tokens at a small batch; 64 errs low).
DEFAULT_MIXED_PREFILL_TOKENS = 64
# Steps with fewer prefill tokens than this say too little about the per-token cost to be used.
MIN_COST_SAMPLE_TOKENS = 16
# Weight of a new observation in the moving averages.
COST_EMA_WEIGHT = 0.25
# The cost model tells a token's own cost b from its attention's c per key only when the recent prefill steps'
# keys per token spread at least this much (standard deviation): prompts of a few hundred tokens alone say
# nothing about c, and a long prompt's successive chunks (hundreds of keys apart) do.
MIN_KEY_SPREAD = 128.0


def mixed_chunk_enabled(args: ServerArgs, device: str) -> bool:
    """On when asked for; on a CPU also by default (scripts/bench_mixed_chunk.py measured lower inter-token
    latency and throughput equal within its noise there, at the cost of a later first token in bursts), unless
    `--disable-mixed-chunk`. Elsewhere it has not been measured, so it stays opt-in."""
    return args.enable_mixed_chunk or (device == "cpu" and not args.disable_mixed_chunk)


@dataclass
class _Moments:
    """Moving averages of a prefill step's per-token cost s and its keys per token k, the regression
    s = b + c k's sufficient statistics (each an EMA with the same weights, so their combinations are a
    weighted mean, variance and covariance)."""

    k: float = 0.0
    s: float = 0.0
    kk: float = 0.0
    ks: float = 0.0
    seen: bool = False

    def add(self, k: float, s: float) -> None:
        if not self.seen:
            self.k, self.s, self.kk, self.ks, self.seen = k, s, k * k, k * s, True
            return
        w = COST_EMA_WEIGHT
        self.k += w * (k - self.k)
        self.s += w * (s - self.s)
        self.kk += w * (k * k - self.kk)
        self.ks += w * (k * s - self.ks)

    def slope(self) -> float | None:
        """The least-squares c of s = b + c k, where the steps' contexts spread enough to tell b from c."""
        spread = self.kk - self.k * self.k
        return (self.ks - self.k * self.s) / spread if spread >= MIN_KEY_SPREAD**2 else None


class MixedChunkBudget:
    def __init__(
        self,
        adaptive: bool = True,
        multiple: float = MIXED_STEP_COST_MULTIPLE,
        floor_seconds: float = MIXED_STEP_FLOOR_SECONDS,
    ):
        self.adaptive = adaptive
        self.multiple = multiple
        self.floor_seconds = floor_seconds
        self.fixed_seconds: float | None = None  # a
        self.token_seconds: float | None = None  # b
        self.key_seconds = 0.0  # c
        self.keys_fitted = False  # c has been measured (until then, contexts beyond `keys_seen` are guarded)
        self.keys_seen = 0.0  # the most keys per token of a step measured, K
        self.keys_seen_seconds = 0.0  # that step's cost per token, s_K
        self._moments = _Moments()  # every prefill-carrying step: b's level
        self._chunk_moments = _Moments()  # steps of at least MIN_LONE_PREFILL_TOKENS prefill tokens: c

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float, keys: int = 0) -> None:
        """One forward step: its prefill tokens, its decoding rows, how long the forward took, and `keys`, the
        keys its rows attended to together (`attention_keys`)."""
        if not self.adaptive:
            return
        if prefill_tokens == 0:
            if decode_tokens and self.token_seconds is not None:
                sample = seconds - self.token_seconds * decode_tokens - self.key_seconds * keys
                self.fixed_seconds = _ema(self.fixed_seconds, max(sample, 0.0))
        elif prefill_tokens >= MIN_COST_SAMPLE_TOKENS:
            tokens = prefill_tokens + decode_tokens
            per_token = max(seconds - (self.fixed_seconds or 0.0), 0.0) / tokens
            if per_token > 0.0:
                self._fit(prefill_tokens, keys / tokens, per_token)

    def _fit(self, prefill_tokens: int, keys_per_token: float, per_token: float) -> None:
        """c from the large steps' regression of per-token cost on keys per token (a short prompt's tokens
        carry its step's overhead, which made attention look free: `MIN_LONE_PREFILL_TOKENS`), kept where they
        do not spread; b every step's mean cost less c at their mean keys, c clamped so that b >= 0."""
        self._moments.add(keys_per_token, per_token)
        if keys_per_token >= self.keys_seen:
            self.keys_seen, self.keys_seen_seconds = keys_per_token, per_token
        if prefill_tokens >= MIN_LONE_PREFILL_TOKENS:
            self._chunk_moments.add(keys_per_token, per_token)
            slope = self._chunk_moments.slope()
            if slope is not None:
                self.key_seconds = max(slope, 0.0)
                self.keys_fitted |= slope > 0.0
        mean = self._moments
        self.key_seconds = min(self.key_seconds, mean.s / mean.k if mean.k > 0 else 0.0)
        self.token_seconds = mean.s - self.key_seconds * mean.k

    def prefill_tokens(self, decode_tokens: int, decode_keys: int = 0) -> int:
        """Prefill tokens the next mixed step may carry next to `decode_tokens` decoding requests, whose rows
        attend to `decode_keys` keys together (the new prompts' own are priced from an empty prefix)."""
        if self.token_seconds is None:
            return DEFAULT_MIXED_PREFILL_TOKENS
        # `a` is learnt from decode steps, and while prompts keep arriving every step is mixed; until one
        # comes, 0 (b then carries the fixed cost, and the predicted step time stays right)
        decode_step = self._rows_seconds(decode_tokens, decode_keys)
        spare = max((self.multiple - 1.0) * decode_step, self.floor_seconds - decode_step)
        return max(MIN_MIXED_PREFILL_TOKENS, int(self._tokens_within(spare, prefix=0)))

    def lone_prefill_tokens(
        self, decode_tokens: int = 0, decode_keys: int = 0, prefix: int = 0
    ) -> int | None:
        """Prefill tokens of a step bounded by LONE_PREFILL_STEP_SECONDS: one with nothing decoding, or one
        that continues a long prompt whose `prefix` tokens are in KV next to `decode_tokens` decoding rows
        (attending to `decode_keys` keys); never fewer than MIN_LONE_PREFILL_TOKENS.
        DEFAULT_LONE_PREFILL_TOKENS before b is measured; None where the model is not fed (tensor
        parallelism: the chunk size alone bounds the step, the same on every rank)."""
        if self.token_seconds is None:
            return DEFAULT_LONE_PREFILL_TOKENS if self.adaptive else None
        spare = LONE_PREFILL_STEP_SECONDS - self._rows_seconds(decode_tokens, decode_keys)
        return max(MIN_LONE_PREFILL_TOKENS, int(self._tokens_within(spare, prefix)))

    def _rows_seconds(self, decode_tokens: int, decode_keys: int) -> float:
        """A step's fixed cost plus that of its decode rows: a + b D + c K."""
        assert self.token_seconds is not None
        return (
            (self.fixed_seconds or 0.0) + self.token_seconds * decode_tokens + self.key_seconds * decode_keys
        )

    def _tokens_within(self, seconds: float, prefix: int) -> float:
        """The chunk size C whose prefill after `prefix` tokens costs `seconds`: each of its tokens costs b, and
        c for each key it attends to, C P + C (C + 1) / 2 in all, so C solves
        (c / 2) C^2 + (b + c (P + 1/2)) C = seconds.

        Until c is measured, a chunk reaching beyond the contexts measured (`keys_seen`, K keys a token, at
        s_K seconds a token) is guarded: it may cost no more than if a token's whole cost grew with its keys,
        s_K / K a key (an upper bound where a token costs b + c k, both unknown but not negative). Unguarded,
        a fresh server's first long prompt took a second chunk as large as its first, deep into its context:
        912 tokens after 878, in 1.64 s."""
        if seconds <= 0.0:
            return 0.0
        b, c = self.token_seconds, self.key_seconds
        assert b is not None
        chunk = _root(c / 2.0, b + c * (prefix + 0.5), seconds)
        if self.keys_fitted or not 0.0 < self.keys_seen < prefix + (chunk + 1.0) / 2.0:
            return chunk  # (a model set by hand, with no step measured, is not guarded)
        g = self.keys_seen_seconds / self.keys_seen
        return min(chunk, _root(g / 2.0, g * (prefix + 0.5), seconds))


def _root(quadratic: float, linear: float, seconds: float) -> float:
    """The positive C with quadratic C^2 + linear C = seconds (0 where linear is not positive); written so
    that quadratic = 0 gives seconds / linear."""
    if linear <= 0.0:
        return 0.0
    return 2.0 * seconds / (linear + math.sqrt(linear * linear + 4.0 * quadratic * seconds))


def attention_keys(extends: Iterable[tuple[int, int]]) -> int:
    """The keys a step's rows attend to together, the cost model's context term: C rows after P tokens in KV
    (`extends`: (P, C) pairs; a decode row is C = 1, a verify run its drafts and one more) attend to
    C P + C (C + 1) / 2."""
    return sum(chunk * prefix + chunk * (chunk + 1) // 2 for prefix, chunk in extends)


def _ema(old: float | None, sample: float) -> float:
    return sample if old is None else old + COST_EMA_WEIGHT * (sample - old)
