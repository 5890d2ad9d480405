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

import httpx
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


@pytest.fixture(scope="session")
def plain_server() -> Iterator[ServerHandle]:
    """One embedded-model server with srt's defaults and no API key, shared by the modules that need nothing
    else of it (a start costs tens of seconds on 2 cores). A case that reads /metrics counts its own traffic
    (after minus before): the server has served other modules."""
    with running_server() as handle:
        yield handle


# Short enough that the constraints whose first masks take seconds are refused by the budget.
GRAMMAR_COMPILE_TIMEOUT_SECONDS = 1.5


@pytest.fixture(scope="session")
def short_grammar_budget_server() -> Iterator[ServerHandle]:
    """One embedded-model server with an API key and a short --grammar-compile-timeout, shared by the modules
    that send hostile constraints (a case that needs the judge itself sends a constraint no other sends: a
    remembered verdict would not reach it)."""
    flags = ("--grammar-compile-timeout", str(GRAMMAR_COMPILE_TIMEOUT_SECONDS))
    with running_server(*flags, api_key=API_KEY) as handle:
        yield handle


@pytest.fixture(scope="session")
def tiny_fp32_server(tiny_model_dir: str) -> Iterator[ServerHandle]:
    """The tiny random Llama in fp32 on one rank, shared by the modules whose tensor-parallel servers (on one
    machine, over two nodes) must answer as it does, token for token (fp32 on both sides: int8 quantizes
    each rank's shard on its own)."""
    with running_server("--model-path", tiny_model_dir, "--quantization", "none") as handle:
        yield handle


def flush_cache(server: ServerHandle) -> None:
    """Empty a shared server's prefix cache: a reference run then computes every prompt's KV itself, as on a
    fresh server."""
    r = httpx.post(f"{server.base_url}/flush_cache", headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def child_pids(server: ServerHandle) -> dict[str, int]:
    """The module's server's children (name -> pid) before its first case: a hostile case must leave them
    unchanged. Each module defines its own `server` fixture."""
    pids = server.child_pids()
    assert {"srt-scheduler", "srt-detokenizer"} <= set(pids), pids
    return pids
