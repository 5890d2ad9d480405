"""The server's processes among themselves: their names, how a child notices its parent died, how the
launcher stops them (and why not with SIGTERM), finding and killing a process tree, the open-files limit.

Nothing here imports torch or prometheus_client: the launcher imports this module before it sets up the
metrics directory, and the HTTP process must never load torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import threading
import time

logger = logging.getLogger(__name__)

# prctl option that sets the thread name shown in /proc/<pid>/comm, ps and top (15 bytes at most).
PR_SET_NAME = 15
PROCESS_NAME_MAX_BYTES = 15
# prctl option that makes the kernel signal a child when its parent dies (Linux only).
PR_SET_PDEATHSIG = 1
# How often a child checks that its parent is still alive, as a fallback where prctl is unavailable.
PARENT_POLL_SECONDS = 1.0
# Time a process gets to exit after the signal that asks it to stop before it is SIGKILLed.
TERMINATE_GRACE_SECONDS = 3.0
# The signal the launcher stops its children with. Not SIGTERM: service managers (systemd's default
# KillMode=control-group, `kill -- -PGID`) send SIGTERM to every process of the server at once, and a
# child that died of it would cut the in-flight requests the launcher is draining. So the children ignore
# SIGTERM (and SIGINT, which Ctrl-C sends to the whole process group) and die of this one, whose default
# action ends the process as SIGTERM's did.
CHILD_STOP_SIGNAL = signal.SIGUSR1
# Index of `starttime` (field 22 of /proc/<pid>/stat) among the fields after the command name (field 2).
STAT_STARTTIME_INDEX = 19


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies, so a crashed launcher never
    leaves orphans. Best effort: a no-op where prctl is unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable")


def leave_stopping_to_the_launcher() -> None:
    """In a child process: ignore SIGINT and SIGTERM, which Ctrl-C and service managers send to every
    process of the server, and die of CHILD_STOP_SIGNAL, which the launcher sends once it has drained."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(CHILD_STOP_SIGNAL, signal.SIG_DFL)


def set_process_name(name: str) -> None:
    """Name this process (`srt-scheduler`, `srt-detokenizer`) so ps, top and tests can tell the children
    apart; spawned children otherwise all look like `python -c from multiprocessing.spawn ...`."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:PROCESS_NAME_MAX_BYTES], 0, 0, 0)
    except OSError:
        logger.debug("prctl(PR_SET_NAME) unavailable")


def process_name(pid: int) -> str | None:
    """The kernel's name of `pid` (/proc/<pid>/comm), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def watch_parent_process(interval: float = PARENT_POLL_SECONDS) -> None:
    """Start a daemon thread that exits this process when it is re-parented (its launcher died)."""
    parent = os.getppid()

    def _watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                logger.error("parent process %d is gone; exiting", parent)
                os._exit(1)

    threading.Thread(target=_watch, name="parent-watch", daemon=True).start()


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces; fields after it are fixed.
    return stat[stat.rfind(")") + 2 :].split()


def _children_map() -> dict[int, list[int]]:
    """pid -> child pids, from /proc (no psutil dependency in the serving path)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendant_pids(pid: int) -> list[int]:
    """Every live descendant of `pid`, children before grandchildren."""
    tree = _children_map()
    out: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = []
        for p in frontier:
            for c in tree.get(p, []):
                out.append(c)
                nxt.append(c)
        frontier = nxt
    return out


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def process_start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None if it is gone: with the pid it names one process
    for good, even after the pid is reused."""
    fields = _stat_fields(pid)
    return int(fields[STAT_STARTTIME_INDEX]) if fields is not None else None


def kill_process_tree(
    pid: int, include_parent: bool = True, grace: float = TERMINATE_GRACE_SECONDS, sig: int = signal.SIGTERM
) -> None:
    """Send `sig` to a process and all its descendants, then SIGKILL whatever is still alive after `grace`."""
    targets = descendant_pids(pid)
    if include_parent:
        targets.append(pid)
    for p in targets:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(p) for p in targets):
        time.sleep(0.05)
    for p in targets:
        if pid_alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit (spawned children inherit it) and
    return (before, after). Every HTTP connection holds a descriptor: under the usual soft default of 1,024,
    a thousand idle sockets would leave none for /health."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        logger.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, e)
        return soft, soft
    return soft, hard
