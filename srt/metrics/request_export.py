"""`--export-metrics-to-file`: one JSON line per finished request, in hourly files.

Lines are built on the event loop (a dict of numbers the request already has) and handed to one writer
thread through a bounded queue, so no file I/O ever runs on the event loop: should the disk fall behind, a
full queue drops the line (counted, and logged at most once per DROP_LOG_INTERVAL) rather than stall
requests. The file of each line is named by the UTC hour its request finished in
(`requests-YYYY-MM-DD-HH.jsonl`); a file is opened in append mode when its hour begins and closed when the
next one does, so a rotation tool or `tail -F` sees whole lines only.

This module imports no prometheus_client at import time (the launcher checks the directory before the
metrics directory is set up); the drop counter is created only when metrics are on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import tempfile
import threading
import time
from datetime import UTC, datetime

from srt.child_startup import ConfigError

logger = logging.getLogger(__name__)

FILE_PREFIX = "requests-"
FILE_SUFFIX = ".jsonl"
# Lines waiting for the writer: at ~1 KB each, a few MB at most, and seconds of a busy server's finishes.
EXPORT_QUEUE_SIZE = 8192
# A sustained overload logs its drops this often, not once per line.
DROP_LOG_INTERVAL = 60.0
_STOP = object()


def hourly_file_name(epoch_seconds: float) -> str:
    hour = datetime.fromtimestamp(epoch_seconds, UTC).strftime("%Y-%m-%d-%H")
    return f"{FILE_PREFIX}{hour}{FILE_SUFFIX}"


def check_export_dir(path: str | None) -> str:
    """The directory, created if missing and proven writable; ConfigError with one clear line otherwise."""
    if not path:
        raise ConfigError("--export-metrics-to-file needs --export-metrics-to-file-dir (where to write)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--export-metrics-to-file-dir {path!r} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(
            f"--export-metrics-to-file-dir {path!r} is not writable ({e.strerror or e}): pick a writable "
            "directory"
        ) from None
    return path


class RequestExporter:
    """Writes the lines `submit` gets, from a daemon thread, until `close`."""

    def __init__(self, directory: str, metrics_labels: dict[str, str] | None = None):
        self.directory = directory
        self.dropped = 0
        self._last_drop_log = 0.0
        self._queue: queue.Queue = queue.Queue(EXPORT_QUEUE_SIZE)
        self._drop_counter = None
        if metrics_labels is not None:
            from prometheus_client import Counter

            self._drop_counter = Counter(
                "sglang:request_export_dropped_total",
                "Request-export lines dropped because the writer fell behind.",
                list(metrics_labels),
            ).labels(**metrics_labels)
        self._thread = threading.Thread(target=self._run, name="request-export", daemon=True)
        self._thread.start()

    def submit(self, record: dict) -> None:
        """Queue one line (never blocks); the record's `finish_ts` (epoch) picks its hourly file."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self._drop_counter is not None:
                self._drop_counter.inc()
            now = time.monotonic()
            if now - self._last_drop_log >= DROP_LOG_INTERVAL:
                self._last_drop_log = now
                logger.warning("request export is behind: %d line(s) dropped so far", self.dropped)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the thread."""
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every line submitted so far is written (tests, shutdown)."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)

    def _run(self) -> None:
        name, handle = None, None
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                if isinstance(item, threading.Event):
                    if handle is not None:
                        handle.flush()
                    item.set()
                    continue
                try:
                    wanted = hourly_file_name(item.get("finish_ts") or time.time())
                    if wanted != name:
                        if handle is not None:
                            handle.close()
                        name, handle = (
                            wanted,
                            open(os.path.join(self.directory, wanted), "a", encoding="utf-8"),
                        )
                    handle.write(json.dumps(item, ensure_ascii=False) + "\n")
                    if self._queue.empty():
                        handle.flush()
                except (OSError, TypeError, ValueError):
                    logger.exception("request export: a line could not be written")
                    if handle is not None:
                        with contextlib.suppress(OSError):
                            handle.close()
                    name, handle = None, None
        finally:
            if handle is not None:
                handle.close()
