"""Bounded custom labels on the request-level metrics (`--tokenizer-metrics-custom-labels-header`).

A client names its request's labels in a header holding a JSON object, e.g.
`x-custom-labels: {"tenant": "acme"}`. Prometheus needs label names fixed when a family is created, and every
distinct label value is a new time series kept forever, so both are fixed at start-up by
`--tokenizer-metrics-allowed-custom-labels`, one `name=value1,value2,...` item per label:

- the allowed names become extra label names of every request-level family; a request that does not set one
  gets the empty value (`""`);
- a value outside a name's allowed values becomes `other`; a name outside the allow-list is dropped;
- a header that is not a JSON object of strings, or is longer than MAX_HEADER_CHARS, is ignored (the request
  is served and counted with empty labels): labels are an observability aid, never a reason to fail traffic.

So the series per family are at most the product over names of (allowed values + 2), whatever clients send.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

UNSET_VALUE = ""
OTHER_VALUE = "other"
# A header longer than this is ignored unread: no legitimate label object needs more.
MAX_HEADER_CHARS = 4096
# Each allowed value is one more series per family per other label's value: keep the product small.
MAX_VALUES_PER_LABEL = 64
# Prometheus' label-name syntax; names starting with "__" are reserved.
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Label names the request-level families already use.
RESERVED_NAMES = frozenset({"model_name", "finished_reason", "le", "quantile"})


@dataclass(frozen=True)
class CustomLabelPolicy:
    """Allowed label names (in flag order) and each name's allowed values."""

    allowed: tuple[tuple[str, frozenset[str]], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.allowed)

    @property
    def default(self) -> tuple[str, ...]:
        return (UNSET_VALUE,) * len(self.allowed)

    def resolve(self, header: str | None) -> tuple[str, ...]:
        """The label values (in `names` order) for a request whose header is `header`."""
        if not self.allowed or not header or len(header) > MAX_HEADER_CHARS:
            return self.default
        try:
            given = json.loads(header)
        except ValueError:
            return self.default
        if not isinstance(given, dict):
            return self.default
        values = []
        for name, allowed in self.allowed:
            value = given.get(name)
            if value is None:
                values.append(UNSET_VALUE)
            else:
                values.append(value if isinstance(value, str) and value in allowed else OTHER_VALUE)
        return tuple(values)


def parse_allowed_custom_labels(items: list[str] | None) -> CustomLabelPolicy:
    """`["tenant=a,b,c", "tier=free,paid"]` -> the policy; ValueError with one clear line otherwise."""
    if not items:
        return CustomLabelPolicy()
    allowed: list[tuple[str, frozenset[str]]] = []
    for item in items:
        name, sep, values_text = item.partition("=")
        name = name.strip()
        values = [v.strip() for v in values_text.split(",")] if sep else []
        if not sep or not values or any(not v for v in values):
            raise ValueError(
                f"--tokenizer-metrics-allowed-custom-labels {item!r}: write name=value1,value2,... — every "
                "label needs its allowed values, or clients could grow the metrics without bound"
            )
        if not LABEL_NAME.match(name) or name.startswith("__") or name in RESERVED_NAMES:
            raise ValueError(
                f"--tokenizer-metrics-allowed-custom-labels: {name!r} is not a usable label name (letters, "
                f"digits and _, not starting with a digit or __, not one of {sorted(RESERVED_NAMES)})"
            )
        if name in {n for n, _ in allowed}:
            raise ValueError(f"--tokenizer-metrics-allowed-custom-labels: {name!r} is given twice")
        if len(values) > MAX_VALUES_PER_LABEL:
            raise ValueError(
                f"--tokenizer-metrics-allowed-custom-labels: {name!r} has {len(values)} values; at most "
                f"{MAX_VALUES_PER_LABEL} are allowed"
            )
        allowed.append((name, frozenset(values)))
    return CustomLabelPolicy(tuple(allowed))
