"""PNG charts of a benchmark: latency CDFs per run, and throughput / p99 latency against concurrency for a
sweep. Uses matplotlib's non-interactive Agg backend: benchmarks run on headless machines."""

from __future__ import annotations

import logging
import os

from srt_bench.runner import RunResult
from srt_bench.stats import MS_PER_S

logger = logging.getLogger(__name__)

DPI = 120
LATENCIES = ("ttft", "itl", "e2e")
LATENCY_TITLES = {"ttft": "Time to first token", "itl": "Inter-token latency", "e2e": "End-to-end latency"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _latency_values(run: RunResult, name: str) -> list[float]:
    ok = [r for r in run.results if r.success]
    if name == "itl":
        return [gap * MS_PER_S for r in ok for gap in r.itl]
    return [getattr(r, name) * MS_PER_S for r in ok]


def plot_cdfs(runs: list[RunResult], out_dir: str, label: str = "") -> list[str]:
    """One CDF chart per latency, one curve per concurrency level."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name in LATENCIES:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            values = sorted(_latency_values(run, name))
            if not values:
                continue
            fractions = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
            label_text = f"concurrency {run.max_concurrency or 'inf'}"
            ax.step([values[0], *values], fractions, where="post", label=label_text)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of observations")
        ax.set_title(f"{LATENCY_TITLES[name]} CDF {label}".strip())
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = os.path.join(out_dir, f"{label + '_' if label else ''}{name}_cdf.png")
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_sweep(series: dict[str, list[RunResult]], out_dir: str) -> list[str]:
    """Output throughput and p99 TTFT/ITL against concurrency; one line per server (or one for a sweep)."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    charts = {
        "throughput_vs_concurrency.png": ("output tok/s", lambda s: s.output_throughput),
        "ttft_p99_vs_concurrency.png": ("TTFT p99 (ms)", lambda s: s.ttft.p99_ms),
        "itl_p99_vs_concurrency.png": ("ITL p99 (ms)", lambda s: s.itl.p99_ms),
    }
    paths = []
    for filename, (ylabel, value) in charts.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, runs in series.items():
            xs = [run.max_concurrency or 0 for run in runs]
            ax.plot(xs, [value(run.summary) for run in runs], marker="o", label=name)
        if all(run.max_concurrency for runs in series.values() for run in runs):
            ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = os.path.join(out_dir, filename)
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        paths.append(path)
    return paths
