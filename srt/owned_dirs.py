"""Temporary directories owned by a launcher process, and the removal of those a killed launcher left."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from srt.process_control import pid_alive, process_start_time

logger = logging.getLogger(__name__)


# Temporary directories of a server (ZMQ sockets, metrics files) are named `<prefix><pid>-<start>-<random>`
# after the launcher that owns them, so a later start can remove those a SIGKILLed launcher left behind.
def make_owned_temp_dir(prefix: str, parent: str | None = None) -> str:
    """A fresh temporary directory whose name records this process (pid and start time) as its owner."""
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"{prefix}{pid}-{process_start_time(pid) or 0}-", dir=parent)


def owner_alive(name: str, prefix: str) -> bool | None:
    """Whether the process named in an owned directory's name still runs (the same process: a reused pid
    has another start time); None for a name that records no owner (left alone)."""
    parts = name[len(prefix) :].split("-")
    if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    pid, start = int(parts[0]), int(parts[1])
    return pid_alive(pid) and process_start_time(pid) in (start, None)


def remove_stale_dirs(prefix: str, parent: str | None = None) -> list[str]:
    """Remove the `prefix` directories in `parent` (default: the temp dir) whose owner process is gone; a
    live server's directories, and directories that record no owner, are kept. Returns the removed paths."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        entries = [
            e for e in os.scandir(parent) if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)
        ]
    except OSError:
        return removed
    for entry in entries:
        if owner_alive(entry.name, prefix) is False:
            shutil.rmtree(entry.path, ignore_errors=True)
            logger.info("removed %s: its owner process is gone", entry.path)
            removed.append(entry.path)
    return removed
