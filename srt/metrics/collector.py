"""The public names of srt's metric writers, one import for every caller. Importing this module imports
prometheus_client: call `srt.metrics.multiprocess.setup_multiprocess_dir()` first (docs/metrics.md,
"The metrics directory's lifecycle")."""

from srt.metrics.http import (
    METRICS_CONTENT_TYPE,
    instrument_http_app,
    make_metrics_asgi_app,
    make_metrics_registry,
)
from srt.metrics.process_collector import PROCESS_METRICS_INTERVAL, start_process_metrics
from srt.metrics.request_stats import FinishedRequestStats, inter_token_latencies
from srt.metrics.scheduler_collector import (
    SchedulerMetricsCollector,
    SchedulerStats,
    load_factor,
    make_cache_config,
    max_concurrency_estimate,
)
from srt.metrics.tokenizer_collector import FINISHED_REASONS, TokenizerMetricsCollector

__all__ = [
    "FINISHED_REASONS",
    "METRICS_CONTENT_TYPE",
    "PROCESS_METRICS_INTERVAL",
    "FinishedRequestStats",
    "SchedulerMetricsCollector",
    "SchedulerStats",
    "TokenizerMetricsCollector",
    "inter_token_latencies",
    "instrument_http_app",
    "load_factor",
    "make_cache_config",
    "make_metrics_asgi_app",
    "make_metrics_registry",
    "max_concurrency_estimate",
    "start_process_metrics",
]
