"""Per-process CPU, memory and file-descriptor metrics with a `component` label.

prometheus_client's built-in process collector reports nothing in multiprocess mode (it reads only the
scraping process), so each srt process refreshes its own from a daemon thread instead.

Every process's samples carry the same label names (PROCESS_LABELS), a process without a rank giving an
empty value, which Prometheus reads as no label: strict exposition parsers (the Shepherd Model Gateway's
`/engine_metrics`, which merges its workers' `/metrics`) refuse a family whose samples have different label
sets.
"""

from __future__ import annotations

import logging
import os
import threading

from prometheus_client import Counter, Gauge

logger = logging.getLogger(__name__)

# Seconds between refreshes: fine enough for a 15 s scrape interval, negligible cost.
PROCESS_METRICS_INTERVAL = 5.0
GAUGE_MODE = "livemostrecent"
_PROC_STATM = "/proc/self/statm"
_PROC_FDS = "/proc/self/fd"
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

# The label names of every per-process sample, `component` after them.
PROCESS_LABELS = ("model_name", "tp_rank", "dp_rank")

_started_in_pid: int | None = None  # one refresher per process: a second would double-count CPU


def cpu_seconds() -> float:
    """User + system CPU time of this process (children excluded: they report their own)."""
    t = os.times()
    return t.user + t.system


def resident_memory_bytes() -> int:
    with open(_PROC_STATM) as f:
        return int(f.read().split()[1]) * _PAGE_SIZE


def open_fds() -> int:
    return len(os.listdir(_PROC_FDS))


class ProcessMetricsThread(threading.Thread):
    def __init__(self, component: str, labels: dict[str, str], interval: float) -> None:
        super().__init__(name=f"srt-process-metrics-{component}", daemon=True)
        unknown = set(labels) - set(PROCESS_LABELS)
        if unknown:
            raise ValueError(f"process metrics take only the labels {PROCESS_LABELS}, not {sorted(unknown)}")
        names = [*PROCESS_LABELS, "component"]
        values = {**{name: labels.get(name, "") for name in PROCESS_LABELS}, "component": component}
        self._cpu = Counter("sglang:process_cpu_seconds", "CPU seconds of this process.", names).labels(
            **values
        )
        self._rss = Gauge(
            "sglang:process_resident_memory_bytes", "Resident memory.", names, multiprocess_mode=GAUGE_MODE
        ).labels(**values)
        self._fds = Gauge(
            "sglang:process_open_fds", "Open file descriptors.", names, multiprocess_mode=GAUGE_MODE
        ).labels(**values)
        self._interval = interval
        self._stop = threading.Event()
        self._last_cpu = 0.0

    def refresh(self) -> None:
        now_cpu = cpu_seconds()
        self._cpu.inc(max(0.0, now_cpu - self._last_cpu))
        self._last_cpu = now_cpu
        try:
            self._rss.set(resident_memory_bytes())
            self._fds.set(open_fds())
        except OSError as e:  # no /proc (not Linux): CPU still counts
            logger.debug("process metrics unavailable: %s", e)

    def run(self) -> None:
        while True:
            self.refresh()
            if self._stop.wait(self._interval):
                return

    def stop(self) -> None:
        self._stop.set()


def start_process_metrics(
    component: str, labels: dict[str, str], interval: float = PROCESS_METRICS_INTERVAL
) -> ProcessMetricsThread | None:
    """Start this process's refresher (at most once per process); the first refresh happens at once."""
    global _started_in_pid
    if _started_in_pid == os.getpid():
        return None
    _started_in_pid = os.getpid()
    thread = ProcessMetricsThread(component, labels, interval)
    thread.refresh()
    thread.start()
    return thread
