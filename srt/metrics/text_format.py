"""A small reader of the Prometheus text exposition, for tests and benchmarks that check `/metrics`
without importing prometheus_client (importing it in a process fixes its storage mode for good)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')
_SPECIAL = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics_text(text: str) -> list[Sample]:
    """Every sample line of `text` (comments skipped); raises ValueError on a malformed line."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a sample line: {line!r}")
        labels = {lm["key"]: lm["value"] for lm in _LABEL.finditer(m["labels"] or "")}
        raw = m["value"]
        samples.append(Sample(m["name"], labels, _SPECIAL[raw] if raw in _SPECIAL else float(raw)))
    return samples


def metric_types(text: str) -> dict[str, str]:
    """Family name -> type, from the `# TYPE` lines."""
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind
    return types


def select(samples: list[Sample], name: str, **labels: str) -> list[Sample]:
    """Samples called `name` whose labels include `labels`."""
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the matching samples (0 if none): e.g. a counter over all its label sets."""
    return sum(s.value for s in select(samples, name, **labels))
