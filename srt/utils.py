"""Small process and socket helpers shared by the launcher and the subprocesses.

Nothing here imports torch or prometheus_client: the launcher imports this module before it sets up the
metrics directory, and the HTTP process must never load torch.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import zmq

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


class ConfigError(Exception):
    """A start-up problem the user fixes by changing a flag or an environment value (the launcher reports it
    in one line and exits with code 2, as argparse does for a bad flag)."""


ADVISORY_WARNINGS_ENV = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def load_tokenizer(path: str):
    """`AutoTokenizer.from_pretrained(path)`, keeping torch out of a process that has not loaded it yet.

    Why: transformers imports torch whenever it is installed, and torch's libraries then stay resident
    (about 240 MB) in processes that only tokenize and detokenize (the HTTP process, the detokenizer).
    Without torch, transformers still loads tokenizers ("only tokenizers, configuration and file/data
    utilities"). The block is lifted afterwards, so a later `import torch` (an optional grammar backend's)
    still works."""
    hide = "torch" not in sys.modules
    # transformers' first import would warn that PyTorch was not found: true here, and meant
    quiet = hide and "transformers" not in sys.modules and ADVISORY_WARNINGS_ENV not in os.environ
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # the import system's "not importable"
    if quiet:
        os.environ[ADVISORY_WARNINGS_ENV] = "1"
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    finally:
        if hide and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
        if quiet:
            del os.environ[ADVISORY_WARNINGS_ENV]


def get_zmq_socket(
    context: zmq.Context, socket_type: int, endpoint: str, bind: bool, hwm: int | None = 0
) -> zmq.Socket:
    """Every ZMQ socket of srt, bound or connected, never lingering at close. The ring's PUSH/PULL sockets
    keep the default unlimited high-water marks (`hwm=0`): a full queue must never block or drop a message
    (the ring carries one message per scheduler step, so memory stays bounded by the work in flight). A
    publisher to outside subscribers passes its own bound (None keeps ZMQ's)."""
    sock = context.socket(socket_type)
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


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


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind (without listening yet) the HTTP server's socket, so a taken port or a bad host fails at once,
    before any child process starts; connections are refused until the server listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is reusable
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use: stop the process that holds it or choose another "
                "--port"
            ) from None
        reason = e.strerror or str(e)
        raise ConfigError(f"cannot listen on {host}:{port} ({reason}): check --host and --port") from None
    return sock


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


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# glibc returns every freed block above the mmap threshold to the kernel, so each forward step's multi-MB
# activations come back as fresh pages and pay a page fault per 4 KiB on first touch (measured on the
# embedded model: batch-1 decode 71 -> 59 ms/step with the heap kept). Children read these at exec.
CHILD_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(8 << 30),
}


def release_free_heap() -> None:
    """Hand the heap's free memory back to the kernel once (glibc's malloc_trim), after a one-time phase that
    freed a lot — the fp32 weights that int8 replaced — which CHILD_MALLOC_ENV would otherwise keep
    resident for the process's life. A no-op where glibc is not the allocator."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def keep_heap_for_children() -> None:
    """Make spawned children (scheduler, detokenizer) keep freed memory in their heap; a value the user set
    wins."""
    for key, value in CHILD_MALLOC_ENV.items():
        os.environ.setdefault(key, value)
