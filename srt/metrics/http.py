"""The `/metrics` endpoint and the HTTP-level metrics of the main process.

`/metrics` aggregates every process's files with `MultiProcessCollector` at each scrape. The endpoint is an
ASGI callable *object* (not a function) so that `app.add_route("/metrics", make_metrics_asgi_app())`
serves it directly at `/metrics` — `app.mount("/metrics", ...)` would answer `/metrics` with a redirect to
`/metrics/`, which some scrapers do not follow.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from srt.metrics.lora_state import LoRAStateCollector
from srt.metrics.multiprocess import multiprocess_dir

# The classic text format every Prometheus and promtool understands.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Scraping and health checks would otherwise dominate the request metrics.
EXCLUDED_HANDLERS = ("/metrics", "/health")


class MetricsASGIApp:
    """Serves the aggregated text exposition for any method at the path it is routed to."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = generate_latest(self._registry)
        headers = [
            (b"content-type", METRICS_CONTENT_TYPE.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body if scope.get("method") != "HEAD" else b""})


def make_metrics_registry(path: str | None = None) -> CollectorRegistry:
    """A registry that reads every process's files from PROMETHEUS_MULTIPROC_DIR (or `path`) at collect."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    registry.register(LoRAStateCollector(path or multiprocess_dir()))
    return registry


def make_metrics_asgi_app(path: str | None = None) -> MetricsASGIApp:
    return MetricsASGIApp(make_metrics_registry(path))


def instrument_http_app(app, labels: dict[str, str]) -> None:
    """HTTP request counts, latencies and sizes through prometheus_fastapi_instrumentator, with our constant
    labels, excluding /metrics and /health. Values go to the multiprocess directory like every other
    metric, because prometheus_client was imported after it was set."""
    from prometheus_fastapi_instrumentator import Instrumentator, metrics

    excluded = [f"^{re.escape(h)}$" for h in EXCLUDED_HANDLERS]
    instrumentator = Instrumentator(excluded_handlers=excluded, should_group_status_codes=True)
    instrumentator.add(metrics.default(custom_labels=dict(labels)))
    instrumentator.instrument(app)
