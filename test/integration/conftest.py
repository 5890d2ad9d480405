"""Real srt servers for integration tests: `python -m srt.launch_server` as a subprocess on a free port.

Use `running_server(*flags)` as a context manager (e.g. in a module-scoped fixture), `launch_server` when a
test wants to control the process itself (kill children, send signals), or the `server_factory` fixture
for servers that live as long as one test. Every server is started in its own session (process group),
so teardown can kill the whole tree even if the launcher misbehaves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from srt.constrained.judge import JUDGE_PROCESS_NAME
from srt.process_control import descendant_pids, pid_alive, process_name
from srt.sockets import find_free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
# A start with cold caches converts the GGUF, calibrates int8 and builds the C kernels (about a minute on a
# quiet 2-core machine, several beside other work); a start that fails ends the wait at once, whatever this is.
STARTUP_TIMEOUT_SECONDS = 600.0
STOP_TIMEOUT_SECONDS = 20.0
HEALTH_POLL_SECONDS = 0.5
API_KEY = "sk-srt-test"


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None
    flags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_SECONDS) -> int | None:
        """Signal the launcher, wait for it, then kill whatever of its session is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        return self.proc.returncode


def session_pids(sid: int) -> list[int]:
    """Live processes of a session (the launcher's tree even after re-parenting)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid and pid_alive(int(entry)):
                out.append(int(entry))
        except OSError:
            continue
    return out


def launch_server(
    *flags: str,
    api_key: str | None = None,
    timeout: float = STARTUP_TIMEOUT_SECONDS,
    wait: bool = True,
    env: dict[str, str] | None = None,
    preexec_fn=None,
) -> ServerHandle:
    """Start a server with `flags` on a free port; with `wait`, return once /health answers 200 (raise
    with the server's log if it exits or does not come up in time).

    The server inherits the test process's environment with `env` merged over it, except that a
    PROMETHEUS_MULTIPROC_DIR is never inherited: only an explicit one in `env` reaches the server.
    `preexec_fn` runs in the server process before it starts (e.g. to lower its resource limits)."""
    port = find_free_port()
    args = [*flags, *(("--api-key", api_key) if api_key else ())]
    cmd = [sys.executable, "-m", "srt.launch_server", "--port", str(port), *args]
    base_env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    log = Path(tempfile.mkstemp(prefix=f"srt-server-{port}-", suffix=".log")[1])
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env={**base_env, **(env or {})},
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    handle = ServerHandle(proc, port, log, api_key, tuple(flags))
    if wait:
        try:
            wait_healthy(handle, timeout)
        except BaseException:
            handle.stop(signal.SIGKILL)
            raise
    return handle


def config_error_line(*flags: str, timeout: float = STARTUP_TIMEOUT_SECONDS) -> str:
    """Start a server that must refuse its configuration: it exits 2 with exactly one ERROR line, a
    `start-up failed` one, and no traceback. Returns that line."""
    handle = launch_server(*flags, wait=False)
    try:
        assert handle.proc.wait(timeout) == 2
        log = handle.logs()
        assert "Traceback" not in log, log
        errors = [line for line in log.splitlines() if "ERROR" in line]
        assert len(errors) == 1 and "start-up failed" in errors[0], log
        return errors[0]
    finally:
        handle.stop()
        handle.log_path.unlink(missing_ok=True)


def wait_healthy(handle: ServerHandle, timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {handle.proc.returncode} during start-up:\n{handle.logs()}"
            )
        try:
            if httpx.get(f"{handle.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_SECONDS)
    raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{handle.logs()}")


@contextlib.contextmanager
def running_server(*flags: str, api_key: str | None = None) -> Iterator[ServerHandle]:
    handle = launch_server(*flags, api_key=api_key)
    try:
        yield handle
    finally:
        handle.stop()
        handle.log_path.unlink(missing_ok=True)


@pytest.fixture
def server_factory():
    """Start servers inside one test; all are stopped when the test ends."""
    started: list[ServerHandle] = []

    def factory(*flags: str, **kw) -> ServerHandle:
        handle = launch_server(*flags, **kw)
        started.append(handle)
        return handle

    yield factory
    for handle in started:
        handle.stop()
        handle.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def default_server() -> Iterator[ServerHandle]:
    """One embedded-model server with an API key, shared by the test_server_* modules. fp32
    (`--quantization none`): its greedy output is compared with transformers token for token."""
    with running_server("--quantization", "none", api_key=API_KEY) as handle:
        yield handle


@pytest.fixture(scope="module")
def child_pids(server: ServerHandle) -> dict[str, int]:
    """The module's server's children (name -> pid) before its first case: a hostile case must leave them
    unchanged. Each module defines its own `server` fixture."""
    pids = server.child_pids()
    assert {"srt-scheduler", "srt-detokenizer"} <= set(pids), pids
    return pids
