"""The lifecycle of `PROMETHEUS_MULTIPROC_DIR` (docs/metrics.md, "The metrics directory's lifecycle").

prometheus_client picks its value storage when it is first imported: with the variable set, every metric
writes to mmap'ed files in that directory; without it, values stay in process memory where `/metrics`
never sees them. So the launcher calls `setup_multiprocess_dir()` first thing, before anything imports
prometheus_client and before any child is spawned (children inherit the variable). This module therefore
must not import prometheus_client at import time.

Every run gets a fresh directory, so a restarted server never continues an earlier run's counters and a pid
reused from an earlier run never picks up that run's files. The directory's name records its owner (the
launcher), so the next start removes the directories of launchers that were killed before they could.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import sys

from srt.child_startup import ConfigError
from srt.owned_dirs import make_owned_temp_dir, remove_stale_dirs

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_DIR_PREFIX = "srt-metrics-"
_PROMETHEUS_MODULE = "prometheus_client"

# The directory this process created (and so may remove); None until setup. One server per process.
_created_dir: str | None = None


def check_prometheus_not_imported_yet() -> None:
    """Fail loudly if prometheus_client is already loaded: its storage class is fixed, and metrics would
    silently stay in this process's memory instead of the shared directory."""
    if _PROMETHEUS_MODULE in sys.modules:
        raise RuntimeError(
            "prometheus_client was imported before srt set PROMETHEUS_MULTIPROC_DIR; metrics of this process "
            "would be invisible to /metrics. Call srt.metrics.multiprocess.setup_multiprocess_dir() before "
            "importing anything that imports prometheus_client."
        )


def stale_db_files(directory: str) -> list[str]:
    """The prometheus_client value files directly in `directory` (left by some earlier run)."""
    return sorted(glob.glob(os.path.join(directory, "*.db")))


def setup_multiprocess_dir() -> str:
    """Create this run's fresh metrics directory, point `PROMETHEUS_MULTIPROC_DIR` at it and return it.

    A directory the user already named in the variable is kept as the parent: srt writes into a new
    sub-directory of it (and warns if old `.db` files lie there, since a naive collector over that
    directory would add them in). An unusable directory is a ConfigError naming the variable."""
    global _created_dir
    check_prometheus_not_imported_yet()
    parent = os.environ.get(MULTIPROC_ENV)
    if parent:
        _make_parent(parent)
        stale = stale_db_files(parent)
        if stale:
            logger.warning(
                "%s=%s holds %d .db file(s) from an earlier run (e.g. %s); srt ignores them and writes to a "
                "fresh sub-directory",
                MULTIPROC_ENV,
                parent,
                len(stale),
                os.path.basename(stale[0]),
            )
    remove_stale_dirs(_DIR_PREFIX, parent or None)
    try:
        path = make_owned_temp_dir(_DIR_PREFIX, parent or None)
    except OSError as e:
        where = f"{MULTIPROC_ENV}={parent}" if parent else "the temporary directory"
        raise ConfigError(
            f"{where} is not writable ({e.strerror or e}): point {MULTIPROC_ENV} at a writable directory or "
            "unset it"
        ) from None
    os.environ[MULTIPROC_ENV] = path
    _created_dir = path
    logger.info("metrics directory: %s", path)
    return path


def _make_parent(parent: str) -> None:
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ConfigError(
            f"{MULTIPROC_ENV}={parent} is not a directory: point it at a directory (srt creates a fresh "
            "sub-directory in it) or unset it"
        )
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{MULTIPROC_ENV}={parent} cannot be created ({e.strerror or e}): point it at a writable "
            "directory or unset it"
        ) from None


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV)


def mark_process_dead(pid: int) -> None:
    """Drop the live gauges of an exited child (its counters stay, so totals never go backwards)."""
    path = multiprocess_dir()
    if not path or not os.path.isdir(path):
        return
    from prometheus_client import multiprocess  # deferred: see the module docstring

    multiprocess.mark_process_dead(pid, path)


def cleanup_multiprocess_dir() -> None:
    """Remove the directory `setup_multiprocess_dir` created (never a directory the user owns)."""
    global _created_dir
    if _created_dir is None:
        return
    shutil.rmtree(_created_dir, ignore_errors=True)
    logger.debug("removed metrics directory %s", _created_dir)
    _created_dir = None
