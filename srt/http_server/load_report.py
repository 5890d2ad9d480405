"""ORCA load reports for gateways: vLLM's `endpoint-load-metrics` response header.

A request carrying `endpoint-load-metrics-format: TEXT` (or `JSON`) gets the server's current load in the
response's `endpoint-load-metrics` header, in ORCA's named-metrics form:

    endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.12, named_metrics.num_requests_waiting=0.0, ...
    endpoint-load-metrics: JSON {"named_metrics": {"kv_cache_usage_perc": 0.12, ...}}

The numbers come from the schedulers' gauges (srt/metrics/load_snapshot.py, which says how fresh they are).
Any other format value (ORCA's BIN included), or a server running with `--disable-metrics`, gets no header:
the request itself is never refused for it. A streamed response carries the load at its start.
"""

from __future__ import annotations

import json

from srt.metrics.load_snapshot import LoadSnapshot, SchedulerLoadReader

REQUEST_HEADER = b"endpoint-load-metrics-format"
RESPONSE_HEADER = b"endpoint-load-metrics"
FORMATS = ("TEXT", "JSON")


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
