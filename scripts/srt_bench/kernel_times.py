"""Each C kernel's share of a model step, for scripts/bench_model_forward.py's `--kernel-times`.

`KernelTimes` wraps every `CpuKernels` method named in `KERNELS` with a wall-clock timer while installed (a
`with` block) and puts the originals back on exit; `timed_with_kernels` logs a step's time and then, on
request, the same step rerun under the timers, kernel by kernel, with what no kernel took. The timers add a
little to each call, so the plain figure is measured first, without them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict

from srt.model_executor.layers.cpu_kernels import CpuKernels

logger = logging.getLogger(__name__)


class KernelTimes:
    """Wall time of each of the C kernels' calls (CpuKernels' methods), summed by kernel while installed."""

    KERNELS = (
        "linear",
        "quantize_two_level",
        "combine_two_level",
        "extend_attention",
        "decode_attention",
        "silu_mul",
        "rmsnorm",
        "rope_",
    )

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._originals = {name: getattr(CpuKernels, name) for name in self.KERNELS}

    def __enter__(self) -> KernelTimes:
        for name, method in self._originals.items():
            setattr(CpuKernels, name, self._timed(name, method))
        return self

    def __exit__(self, *exc) -> None:
        for name, method in self._originals.items():
            setattr(CpuKernels, name, method)

    def _timed(self, name, method):
        def timed(kernels, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(kernels, *args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def report(self, steps: int, step_seconds: float) -> str:
        """Per kernel: ms a step, its share of `step_seconds`, calls a step; then what no kernel took."""
        lines = []
        for name, seconds in sorted(self.seconds.items(), key=lambda item: -item[1]):
            ms = seconds / steps * 1e3
            share = 100 * seconds / steps / step_seconds
            lines.append(f"  {name:20s} {ms:7.1f} ms {share:5.1f} %  {self.calls[name] / steps:.0f} calls")
        rest = step_seconds - sum(self.seconds.values()) / steps
        lines.append(
            f"  {'(outside the kernels)':20s} {rest * 1e3:7.1f} ms {100 * rest / step_seconds:5.1f} %"
        )
        return "\n".join(lines)


def timed_with_kernels(kernel_times: bool, label: str, fn, steps_per_call: int) -> None:
    """Log `fn()` (seconds a step); with `kernel_times` (--kernel-times), run it again three times with every kernel call
    timed (the timers add a little to each call) and log each kernel's mean share of a step. The mean counts
    warm-up steps and the building of each step's tables too (in "outside the kernels")."""
    logger.info("%s: %.1f ms a step", label, fn() * 1e3)
    if not kernel_times:
        return
    runs = 3
    with KernelTimes() as kernels:
        start = time.perf_counter()
        for _ in range(runs):
            fn()
        mean = (time.perf_counter() - start) / (runs * steps_per_call)
    report = kernels.report(runs * steps_per_call, mean)
    logger.info(
        "%s, kernels timed (mean of %d steps: %.1f ms):\n%s", label, runs * steps_per_call, mean * 1e3, report
    )
