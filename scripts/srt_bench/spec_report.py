"""What the speculative decoding benchmark (scripts/bench_spec.py) compares and how it judges its rounds: the
configurations, the reference every ratio divides by, the targets, and the report (the table of median rounds
and the checklist of targets).

Each round runs every configuration once; a round's figures met the same minutes of the machine, so a ratio
is taken within a round and the median taken over rounds. Greedy answers of srt's configurations must be
identical to the reference's; llama.cpp's, on other numerics, are not held to that.
"""

from __future__ import annotations

from dataclasses import dataclass

from srt_bench.grounded import SpecFigures, identical_outputs
from srt_bench.runner import RunResult

GROUNDED, OPEN = "grounded", "open"
BATCH_ONE = (GROUNDED, OPEN)
REFERENCE = "srt"


@dataclass(frozen=True)
class Config:
    """One row group of the table: a server, whether grounded requests carry their prediction, and the
    workloads worth running on it (a prediction changes nothing for a request that has none)."""

    server: str  # "srt", "srt-ngram" or "llama.cpp-lookup"
    prediction: bool
    workloads: tuple[str, ...] | None  # None: all of them

    def runs(self, workload: str) -> bool:
        return self.workloads is None or workload in self.workloads


CONFIGS = {
    "srt": Config("srt", False, None),
    "srt-ngram": Config("srt-ngram", False, None),
    "srt-prediction": Config("srt", True, (GROUNDED,)),
    "srt-ngram-prediction": Config("srt-ngram", True, (GROUNDED,)),
    "llama.cpp-lookup": Config("llama.cpp-lookup", False, BATCH_ONE),
}
# (configuration, workload, the one it is divided by, the least ratio the speculative decoding work aims at)
TARGETS = (
    ("srt-ngram", GROUNDED, REFERENCE, 2.0),
    ("srt-ngram", OPEN, REFERENCE, 0.95),
    ("srt-ngram", "random-c16", REFERENCE, 0.97),
    ("srt-ngram", "random-c64", REFERENCE, 0.97),
    ("srt-prediction", GROUNDED, REFERENCE, 3.0),
    ("srt-ngram", GROUNDED, "llama.cpp-lookup", 1.5),
)


@dataclass
class Measurement:
    """One workload on one server: what the client saw, and what srt's counters said (None: no counters)."""

    run: RunResult
    spec: SpecFigures | None


def median_measurements(rounds) -> dict[str, dict[str, Measurement]]:
    """Per configuration and workload, the round of median output tok/s (the lower middle of an even count)."""
    gathered: dict[str, dict[str, list[Measurement]]] = {}
    for results in rounds:
        for name, by_workload in results.items():
            for workload, m in by_workload.items():
                gathered.setdefault(name, {}).setdefault(workload, []).append(m)
    return {
        name: {
            w: sorted(ms, key=lambda m: m.run.summary.output_throughput)[(len(ms) - 1) // 2]
            for w, ms in by_workload.items()
        }
        for name, by_workload in gathered.items()
    }


def identity_counts(rounds, name: str, workload: str) -> tuple[int, int] | None:
    """Answers identical to the reference's in the same round, summed over rounds; None for llama.cpp (other
    numerics) and for the reference itself."""
    if name == REFERENCE or CONFIGS[name].server not in ("srt", "srt-ngram"):
        return None
    same = compared = 0
    for results in rounds:
        ours, ref = results.get(name, {}).get(workload), results.get(REFERENCE, {}).get(workload)
        if ours is not None and ref is not None:
            s, c = identical_outputs(ref.run, ours.run)
            same, compared = same + s, compared + c
    return (same, compared) if compared else None


def ratio(rounds, name: str, workload: str, reference: str) -> float | None:
    """The median over rounds of each round's ratio (the lower middle of an even count): a round's two
    figures met the same minutes of the machine, two medians need not have."""
    per_round = []
    for results in rounds:
        ours, ref = results.get(name, {}).get(workload), results.get(reference, {}).get(workload)
        if ours is not None and ref is not None and ref.run.summary.output_throughput > 0:
            per_round.append(ours.run.summary.output_throughput / ref.run.summary.output_throughput)
    return sorted(per_round)[(len(per_round) - 1) // 2] if per_round else None


def results_table(rounds) -> str:
    medians = median_measurements(rounds)
    lines = [
        "| configuration | workload | ok / failed | output tok/s | ÷ srt | accept length | identical to srt |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, by_workload in medians.items():
        for workload, m in by_workload.items():
            s = m.run.summary
            r = ratio(rounds, name, workload, REFERENCE)
            accept = None if m.spec is None else m.spec.accept_length
            same = identity_counts(rounds, name, workload)
            cells = [
                name, workload, f"{s.completed} / {s.failed}", f"{s.output_throughput:.1f}",
                "-" if r is None else f"{r:.2f}x", "-" if accept is None else f"{accept:.2f}",
                "-" if same is None else f"{same[0]}/{same[1]}",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_checklist(rounds) -> str:
    medians = median_measurements(rounds)
    lines = []
    for name, workload, reference, least in TARGETS:
        r = ratio(rounds, name, workload, reference)
        verdict = "not measured" if r is None else f"{r:.2f}x, {'met' if r >= least else 'MISSED'}"
        lines.append(f"- {name} ÷ {reference}, {workload}: at least {least:.2f}x: {verdict}")
    for name in medians:
        for workload in medians[name]:
            same = identity_counts(rounds, name, workload)
            if same is not None and same[0] != same[1]:
                lines.append(
                    f"- {name}, {workload}: {same[1] - same[0]} answers differ from srt's (greedy: MISSED)"
                )
    return "\n".join(lines)
