"""The one server launcher of the tests, the scripts and the benchmarks: srt (`python -m srt.launch_server`) or
any other server (a peer, the smg gateway) as a subprocess.

Every server starts in its own session (process group) with its output in a log file, is ready when a probe
says so (srt: `/health` answers 200; a peer: a real one-token request, since `/health` means different things
on each), and is stopped by signalling its launcher and then killing whatever of its session is left, so
nothing of its tree outlives it even if the launcher misbehaves. A server that exits while it is awaited
raises at once, with its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from srt.constrained.judge import JUDGE_PROCESS_NAME
from srt.process_control import descendant_pids, process_name
from srt.sockets import find_free_port

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
# A start with cold caches converts the GGUF, calibrates int8 and builds the C kernels (about a minute on a
# quiet 2-core machine, several beside other work); a start that fails ends the wait at once, whatever this is.
STARTUP_TIMEOUT_SECONDS = 600.0
STOP_TIMEOUT_SECONDS = 20.0
READY_POLL_SECONDS = 0.5
# a probe's own bound: a server that accepts the connection but hangs is not ready
PROBE_TIMEOUT_SECONDS = 2.0
# the part of a failed server's log an exception carries (the whole log stays in its file)
LOG_TAIL_CHARS = 20_000

# A probe says why the server is not ready yet, or None once it is.
Probe = Callable[[], str | None]
AsyncProbe = Callable[[], Awaitable[str | None]]


@dataclass
class ServerHandle:
    """A started server. `flags`: srt's command-line flags (empty for other servers)."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None
    flags: tuple[str, ...] = field(default_factory=tuple)
    name: str = "srt"

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http_client(self, timeout: float) -> httpx.Client:
        """An httpx client of this server's base URL, with its API key."""
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def openai_client(self, **kw):
        import openai

        return openai.OpenAI(
            base_url=self.openai_base_url, api_key=self.api_key or "none", max_retries=0, **kw
        )

    def async_openai_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.openai_base_url, api_key=self.api_key or "none", max_retries=0, **kw
        )

    def child_pids(self) -> dict[str, int]:
        """Named descendants of the launcher that serve requests, e.g. {"srt-scheduler": pid,
        "srt-detokenizer": pid}. The grammar judge is left out: it is started in the background and replaced
        by design after a constraint runs past its budget (`judge_pid`)."""
        out = {}
        for pid in descendant_pids(self.proc.pid):
            name = process_name(pid)
            if name and name.startswith("srt-") and name != JUDGE_PROCESS_NAME:
                out[name] = pid
        return out

    def judge_pid(self) -> int | None:
        return next(
            (p for p in descendant_pids(self.proc.pid) if process_name(p) == JUDGE_PROCESS_NAME), None
        )

    def _attempts(self, timeout: float) -> Iterator[None]:
        """One step per probe until `timeout`: raises once the server has exited (with its log), and
        TimeoutError when time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} during start-up "
                    f"(log: {self.log_path}):\n{self.logs()[-LOG_TAIL_CHARS:]}"
                )
            yield

    def _timed_out(self, timeout: float, why: str | None) -> TimeoutError:
        return TimeoutError(
            f"{self.name} not ready after {timeout:.0f} s ({why}; log: {self.log_path}):\n"
            f"{self.logs()[-LOG_TAIL_CHARS:]}"
        )

    @contextlib.contextmanager
    def _killed_on_failure(self) -> Iterator[None]:
        """A server that failed to become ready (or whose wait was interrupted) is killed, tree and all."""
        try:
            yield
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def wait_ready(self, probe: Probe, timeout: float = STARTUP_TIMEOUT_SECONDS) -> float:
        """Seconds until `probe` says ready (see `_attempts` for the failures, after which it is killed)."""
        start, why = time.monotonic(), "no answer yet"
        with self._killed_on_failure():
            for _ in self._attempts(timeout):
                why = probe()
                if why is None:
                    return time.monotonic() - start
                time.sleep(READY_POLL_SECONDS)
            raise self._timed_out(timeout, why)

    async def wait_ready_async(self, probe: AsyncProbe, timeout: float = STARTUP_TIMEOUT_SECONDS) -> float:
        """`wait_ready` for a probe that is a coroutine (a benchmark's own client), inside an event loop."""
        start, why = time.monotonic(), "no answer yet"
        with self._killed_on_failure():
            for _ in self._attempts(timeout):
                why = await probe()
                if why is None:
                    return time.monotonic() - start
                await asyncio.sleep(READY_POLL_SECONDS)
            raise self._timed_out(timeout, why)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_SECONDS) -> int | None:
        """Signal the launcher, wait for it, then kill whatever of its session is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0f s; killing it", self.name, timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        return self.proc.returncode


def health_probe(handle: ServerHandle, path: str = "/health") -> Probe:
    """srt's readiness: `path` answers 200."""

    def probe() -> str | None:
        try:
            status = httpx.get(f"{handle.base_url}{path}", timeout=PROBE_TIMEOUT_SECONDS).status_code
        except httpx.HTTPError as e:
            return f"{path}: {type(e).__name__}"
        return None if status == 200 else f"{path} answered {status}"

    return probe


def start_server(
    command: Sequence[str],
    port: int,
    *,
    name: str = "srt",
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    api_key: str | None = None,
    flags: Sequence[str] = (),
    preexec_fn=None,
    cwd: str | Path | None = None,
) -> ServerHandle:
    """Start `command` (a server that will listen on `port`) in its own session, from `cwd` (None: the
    repository root; `python -m srt...` imports the srt of that tree), its output going to `log_path` (None: a
    new temporary file). It inherits this process's environment with `env`
    merged over it, except that a PROMETHEUS_MULTIPROC_DIR is never inherited: only an explicit one in `env`
    reaches it. `preexec_fn` runs in the server process before it starts (e.g. to lower its limits)."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"{name}-{port}-", suffix=".log")
        os.close(fd)
    base_env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    logger.info("starting %s: %s (log: %s)", name, " ".join(command), log_path)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT if cwd is None else cwd,
            env={**base_env, **(env or {})},
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    return ServerHandle(proc, port, Path(log_path), api_key, tuple(flags), name)


def srt_command(port: int, *flags: str) -> list[str]:
    """srt's launcher on `port` with `flags` (it binds loopback unless they say --host)."""
    return [sys.executable, "-m", "srt.launch_server", "--port", str(port), *flags]


def launch_server(
    *flags: str,
    api_key: str | None = None,
    timeout: float = STARTUP_TIMEOUT_SECONDS,
    wait: bool = True,
    env: dict[str, str] | None = None,
    preexec_fn=None,
    port: int | None = None,
    log_path: str | Path | None = None,
) -> ServerHandle:
    """Start srt with `flags` on `port` (None: a free one); with `wait`, return once /health answers 200
    (raise with the server's log, having killed it, if it exits or does not come up in time)."""
    port = find_free_port() if port is None else port
    args = [*flags, *(("--api-key", api_key) if api_key else ())]
    handle = start_server(
        srt_command(port, *args),
        port,
        log_path=log_path,
        env=env,
        api_key=api_key,
        flags=flags,
        preexec_fn=preexec_fn,
    )
    if wait:
        wait_healthy(handle, timeout)
    return handle


def wait_healthy(handle: ServerHandle, timeout: float = STARTUP_TIMEOUT_SECONDS) -> float:
    """Seconds until srt's /health answers 200."""
    return handle.wait_ready(health_probe(handle), timeout)


@contextlib.contextmanager
def running_server(*flags: str, **kw) -> Iterator[ServerHandle]:
    """`launch_server` for a `with` block: stopped at its end, its log removed unless `log_path` was given."""
    handle = launch_server(*flags, **kw)
    try:
        yield handle
    finally:
        handle.stop()
        if kw.get("log_path") is None:
            handle.log_path.unlink(missing_ok=True)
