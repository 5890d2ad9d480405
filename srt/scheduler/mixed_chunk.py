"""How many prefill tokens a mixed step (`--enable-mixed-chunk`) may carry next to the running batch's decode.

The rule: a mixed step may take at most `MIXED_STEP_COST_MULTIPLE` times as long as a decode step of the
same running batch, or `MIXED_STEP_FLOOR_SECONDS` if that is longer, so a prompt arriving while others
decode stretches their inter-token gap by a bounded amount instead of by a whole prefill.

The scheduler feeds every forward step's time to a step-cost model t = a + b x tokens, fitted online:
`a` (the fixed cost of a step: on a CPU, streaming the weights once) from decode steps, `b` (seconds per
token) from steps carrying at least `MIN_COST_SAMPLE_TOKENS` prefill tokens, both as exponential moving
averages. With D decoding requests, the prefill budget C solves a + b (D + C) = K (a + b D):

    C = (K - 1) (a + b D) / b

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


def mixed_chunk_enabled(args: ServerArgs, device: str) -> bool:
    """On when asked for; on a CPU also by default (scripts/bench_mixed_chunk.py measured lower inter-token
    latency and throughput equal within its noise there, at the cost of a later first token in bursts), unless
    `--disable-mixed-chunk`. Elsewhere it has not been measured, so it stays opt-in."""
    return args.enable_mixed_chunk or (device == "cpu" and not args.disable_mixed_chunk)


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

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One forward step: its prefill tokens, its decoding requests, and how long the forward took."""
        if not self.adaptive:
            return
        if prefill_tokens == 0:
            if decode_tokens and self.token_seconds is not None:
                sample = max(seconds - self.token_seconds * decode_tokens, 0.0)
                self.fixed_seconds = _ema(self.fixed_seconds, sample)
        elif prefill_tokens >= MIN_COST_SAMPLE_TOKENS:
            fixed = self.fixed_seconds or 0.0
            sample = max(seconds - fixed, 0.0) / (prefill_tokens + decode_tokens)
            if sample > 0.0:
                self.token_seconds = _ema(self.token_seconds, sample)

    def prefill_tokens(self, decode_tokens: int) -> int:
        """Prefill tokens the next mixed step may carry next to `decode_tokens` decoding requests."""
        b = self.token_seconds
        if b is None:
            return DEFAULT_MIXED_PREFILL_TOKENS
        # `a` is learnt from decode steps, and while prompts keep arriving every step is mixed; until one
        # comes, 0 (b then carries the fixed cost, and the predicted step time stays right)
        a = self.fixed_seconds or 0.0
        budget = max(
            (self.multiple - 1.0) * (a + b * decode_tokens) / b,
            (self.floor_seconds - a) / b - decode_tokens,
        )
        return max(MIN_MIXED_PREFILL_TOKENS, int(budget))

    def lone_prefill_tokens(self, decode_tokens: int = 0) -> int | None:
        """Prefill tokens of a step bounded by LONE_PREFILL_STEP_SECONDS: one with nothing decoding, or one
        that continues a long prompt next to `decode_tokens` decoding requests (their rows cost b each too);
        never fewer than MIN_LONE_PREFILL_TOKENS.
        DEFAULT_LONE_PREFILL_TOKENS before b is measured; None where the model is not fed (tensor
        parallelism: the chunk size alone bounds the step, the same on every rank)."""
        b = self.token_seconds
        if b is None:
            return DEFAULT_LONE_PREFILL_TOKENS if self.adaptive else None
        a = self.fixed_seconds or 0.0
        return max(MIN_LONE_PREFILL_TOKENS, int((LONE_PREFILL_STEP_SECONDS - a) / b) - decode_tokens)


def _ema(old: float | None, sample: float) -> float:
    return sample if old is None else old + COST_EMA_WEIGHT * (sample - old)
