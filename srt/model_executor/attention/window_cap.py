"""The sliding-window and logit soft-cap arguments of srt's attention kernels, C and Triton alike: one rule for
what they take, and the values they are passed (0 for none: a window of no keys or a cap of 0 means nothing,
so 0 is free to say "off")."""

from __future__ import annotations

import math


def window_and_cap_unsupported(sliding_window: int | None, logit_cap: float | None) -> str | None:
    """Why the kernels cannot take this window or cap (None when they can): a window of at least one
    position (the token's own), a positive finite cap."""
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        return f"a sliding window of {sliding_window!r} positions (the kernels take a whole number >= 1)"
    if logit_cap is not None and not (isinstance(logit_cap, int | float) and 0 < logit_cap < math.inf):
        return f"a logit soft-cap of {logit_cap!r} (the kernels take a positive finite number)"
    return None


def window_and_cap_args(
    sliding_window: int | None, logit_cap: float | None, kernels: str
) -> tuple[int, float]:
    """The kernels' window and cap arguments; ValueError naming `kernels` for values they cannot take."""
    reason = window_and_cap_unsupported(sliding_window, logit_cap)
    if reason is not None:
        raise ValueError(f"{kernels} cannot take {reason}")
    return sliding_window or 0, float(logit_cap or 0.0)
