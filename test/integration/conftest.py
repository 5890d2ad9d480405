"""Real srt servers for integration tests, started by the one launcher of the tests, scripts and benchmarks
(`scripts/srt_bench/server.py`): `python -m srt.launch_server` as a subprocess on a free port.

Use `running_server(*flags)` as a context manager (e.g. in a module-scoped fixture), `launch_server` when a
test wants to control the process itself (kill children, send signals), or the `server_factory` fixture
for servers that live as long as one test. Every server is started in its own session (process group),
so teardown can kill the whole tree even if the launcher misbehaves.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from srt.process_control import pid_alive
from srt_bench.server import REPO_ROOT as REPO_ROOT
from srt_bench.server import STARTUP_TIMEOUT_SECONDS, ServerHandle, launch_server, running_server

API_KEY = "sk-srt-test"


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
