"""Load reports for gateways: SGLang's `GET /v1/loads` and ORCA's `endpoint-load-metrics` response header.

`/v1/loads` answers SGLang's schema, which the Shepherd Model Gateway polls for its load-aware policies:
`{"timestamp", "dp_rank_count", "loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs",
"num_used_tokens", "max_total_num_tokens", "token_usage", ...}]}`, one entry per data-parallel replica with
absolute token counts (integers: the gateway reads them as such). Its `include` query names SGLang's
sections (`core,queues,memory`, ...); srt's figures are all core ones, so every known section answers them
and an unknown one is a 400 naming `include`.

A request carrying `endpoint-load-metrics-format: TEXT` (or `JSON`) gets the server's current load in the
response's `endpoint-load-metrics` header, in ORCA's named-metrics form:

    endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.12, named_metrics.num_requests_waiting=0.0, ...
    endpoint-load-metrics: JSON {"named_metrics": {"kv_cache_usage_perc": 0.12, ...}}

The numbers are the schedulers' own counts (srt/metrics/load_snapshot.py, which says how fresh they are),
kept with metrics on or off. Any other format value (ORCA's BIN included), or no scheduler having reported
yet, gets no header: the request itself is never refused for it. A streamed response carries the load at
its start.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from srt.metrics.load_snapshot import LoadSnapshot, RankLoad, SchedulerLoadReader

REQUEST_HEADER = b"endpoint-load-metrics-format"
RESPONSE_HEADER = b"endpoint-load-metrics"
FORMATS = ("TEXT", "JSON")
# The sections SGLang's /v1/loads `include` query may name.
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def unknown_sections(include: str | None) -> list[str]:
    """The names in a `/v1/loads?include=a,b` query that are not SGLang's sections."""
    asked = [] if include is None else [p.strip() for p in include.split(",") if p.strip()]
    return [p for p in asked if p not in LOAD_SECTIONS]


def rank_entry(load: RankLoad, max_running_requests: int) -> dict:
    waiting, running = load.num_waiting_reqs, load.num_running_reqs
    return {
        "dp_rank": load.dp_rank,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": load.num_used_tokens,
        "max_total_num_tokens": load.max_total_num_tokens,
        "token_usage": load.token_usage,
        "gen_throughput": load.gen_throughput,
        "cache_hit_rate": load.cache_hit_rate,
        "utilization": load.token_usage,  # SGLang's name for the same KV fraction
        "max_running_requests": max_running_requests,
    }


def loads_body(ranks: list[RankLoad], max_running_requests: int) -> dict:
    """SGLang's `/v1/loads` answer: one entry per replica, ordered by `dp_rank`."""
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "dp_rank_count": len(ranks),
        "loads": [rank_entry(r, max_running_requests) for r in ranks],
    }


def named_metrics(load: LoadSnapshot) -> dict[str, float]:
    return {
        "kv_cache_usage_perc": float(load.kv_cache_usage_perc),
        "num_requests_waiting": float(load.num_requests_waiting),
        "num_requests_running": float(load.num_requests_running),
    }


def format_load_report(fmt: str, load: LoadSnapshot) -> str | None:
    """The header value in `fmt` (case-insensitive TEXT or JSON); None for any other format."""
    fmt = fmt.strip().upper()
    metrics = named_metrics(load)
    if fmt == "TEXT":
        return "TEXT " + ", ".join(f"named_metrics.{k}={v!r}" for k, v in metrics.items())
    if fmt == "JSON":
        return "JSON " + json.dumps({"named_metrics": metrics})
    return None


class LoadReportMiddleware:
    """Adds the header to the responses of requests that ask for it; a pure ASGI middleware (see
    srt/http_server/middleware.py for why)."""

    def __init__(self, app, reader: SchedulerLoadReader):
        self.app = app
        self.reader = reader

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        asked = next((v for k, v in scope.get("headers") or [] if k == REQUEST_HEADER), None)
        if asked is None:
            return await self.app(scope, receive, send)

        async def send_with_report(message):
            if message["type"] == "http.response.start":
                load = self.reader.read()
                value = None if load is None else format_load_report(asked.decode("latin-1"), load)
                if value is not None:
                    headers = [*message.get("headers", []), (RESPONSE_HEADER, value.encode("latin-1"))]
                    message = {**message, "headers": headers}
            await send(message)

        return await self.app(scope, receive, send_with_report)
