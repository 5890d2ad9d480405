"""Process-level robustness of a real server: the API key, the body size limit, idle
and slowloris connections under a low open-files limit, stale temp directories, impossible KV sizes, and a
graceful SIGTERM under load."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from srt.http_server.uvicorn_server import HEADER_READ_TIMEOUT_SECONDS
from srt.process_control import process_start_time
from test.integration.conftest import API_KEY, config_error_line, launch_server
from test.unit.test_startup_errors import dead_pid

pytestmark = pytest.mark.slow

BODY_LIMIT = 64 * 1024
SERVER_SOFT_FD_LIMIT = 1024
IDLE_CONNECTIONS = 1100
# /health must answer this fast with all the idle sockets open (generous: the CI machine is busy).
HEALTH_SECONDS = 2.0
# Long enough for the server's once-a-second sweep after the header-read timeout.
CLOSE_WAIT_SECONDS = HEADER_READ_TIMEOUT_SECONDS + 5


def lower_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (SERVER_SOFT_FD_LIMIT, hard))


@pytest.fixture(scope="module")
def stale_root(tmp_path_factory) -> dict[str, Path]:
    """An isolated temp dir holding directories a SIGKILLed launcher would leave, and a live one's."""
    root = tmp_path_factory.mktemp("tmp")
    me = f"{os.getpid()}-{process_start_time(os.getpid())}"
    dirs = {
        "dead ipc": root / f"srt-ipc-{dead_pid()}-1-deadbeef",
        "dead metrics": root / f"srt-metrics-{dead_pid()}-1-deadbeef",
        "live ipc": root / f"srt-ipc-{me}-livebeef",
        "live metrics": root / f"srt-metrics-{me}-livebeef",
    }
    for d in dirs.values():
        d.mkdir()
    return dirs


@pytest.fixture(scope="module")
def server(stale_root):
    """A server with an API key, a small body limit and a soft open-files limit of 1,024 (which it must raise
    itself), whose temp dir holds the stale directories above."""
    root = str(next(iter(stale_root.values())).parent)
    handle = launch_server(
        "--max-request-bytes",
        str(BODY_LIMIT),
        api_key=API_KEY,
        env={"TMPDIR": root, "PROMETHEUS_MULTIPROC_DIR": root},
        preexec_fn=lower_fd_limit,
    )
    yield handle
    handle.stop()
    handle.log_path.unlink(missing_ok=True)


def raw_request(
    port: int, head: bytes, body_pieces: list[bytes] = (), timeout: float = 30
) -> tuple[int, dict]:
    """Send `head` (and body pieces) on a fresh socket, read the response until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        for piece in body_pieces:
            s.sendall(piece)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head_part, _, body = data.partition(b"\r\n\r\n")
    status = int(head_part.split(b" ", 2)[1])
    return status, json.loads(body)


def assert_openai_error(status: int, body: dict, expected: int) -> dict:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- API key ----
def test_api_key_wrong_two_headers_and_right(server):
    url = f"{server.base_url}/v1/models"
    assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(url).status_code == 401
    right = f"Bearer {API_KEY}"
    two = httpx.Headers([("Authorization", right), ("Authorization", right)])
    r = httpx.get(url, headers=two)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url, headers={"Authorization": right}).status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # probes need no key


# ---- body size ----
def test_content_length_over_the_limit_is_413_without_sending_the_body(server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: srt\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {50 * 2**20}\r\n\r\n".encode()
    )
    status, body = raw_request(server.port, head)  # no body sent: the answer cannot wait for it
    err = assert_openai_error(status, body, 413)
    assert err["code"] == "request_too_large" and str(BODY_LIMIT) in err["message"]


def test_chunked_body_over_the_limit_is_cut_with_413(server):
    head = (
        b"POST /generate HTTP/1.1\r\nHost: srt\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    )
    piece = 16 * 1024
    chunks = [b"%x\r\n" % piece + b" " * piece + b"\r\n" for _ in range(BODY_LIMIT // piece + 1)]
    status, body = raw_request(server.port, head, chunks)  # never terminated: cut once over the limit
    assert_openai_error(status, body, 413)


def test_body_within_the_limit_is_served(server):
    body = {"prompt": "Hello" + " " * (BODY_LIMIT // 2), "max_tokens": 2}
    r = httpx.post(f"{server.openai_base_url}/completions", json=body, headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text


# ---- connections ----
def test_server_raised_its_open_files_limit(server):
    limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
    soft, hard = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits).groups()
    assert soft == hard and int(soft) > SERVER_SOFT_FD_LIMIT


def open_idle_connections(port: int, count: int) -> list[socket.socket]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < count + 200:
        pytest.skip(f"the test process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.setblocking(False)
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def slowloris(port: int, outcome: dict) -> None:
    """A connection that sends a header line now and then, never the blank line: `outcome` gets whether the
    server closed it, and after how long."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: srt\r\n")
        start = time.monotonic()
        closed = False
        while time.monotonic() - start < CLOSE_WAIT_SECONDS and not closed:
            time.sleep(1.0)
            try:
                s.sendall(b"X-Slow: 1\r\n")
                s.setblocking(False)
                closed = closed_by_server(s)
                s.setblocking(True)
            except OSError:
                closed = True
        outcome.update(closed=closed, seconds=time.monotonic() - start)
    finally:
        s.close()


def test_idle_and_slowloris_connections_are_closed_and_health_answers_beside_them(server):
    """1,100 idle connections and a slowloris one (a header line a second, never the blank line), at once:
    both are waits for the header-read timeout, so they share one. /health answers fast beside them."""
    outcome: dict = {}
    slow = threading.Thread(target=slowloris, args=(server.port, outcome), daemon=True)
    slow.start()
    socks = open_idle_connections(server.port, IDLE_CONNECTIONS)
    try:
        time.sleep(1.0)  # let the server accept them all
        start = time.monotonic()
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        took = time.monotonic() - start
        print(f"/health with {IDLE_CONNECTIONS} idle connections open: {took * 1000:.0f} ms")
        assert health.status_code == 200 and took < HEALTH_SECONDS
        models = httpx.get(f"{server.openai_base_url}/models", headers=server.headers, timeout=10)
        assert models.status_code == 200
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        while time.monotonic() < deadline:
            open_left = [s for s in socks if not closed_by_server(s)]
            if not open_left:
                break
            time.sleep(0.5)
        assert not open_left, f"{len(open_left)} idle connections still open after {CLOSE_WAIT_SECONDS} s"
    finally:
        for s in socks:
            s.close()
        slow.join(CLOSE_WAIT_SECONDS + 10)
    assert outcome.get("closed"), "a connection that never finishes its headers must be closed"
    assert outcome["seconds"] >= HEADER_READ_TIMEOUT_SECONDS - 1


# ---- stale directories ----
def test_stale_dirs_of_killed_launchers_are_removed_live_ones_kept(server, stale_root):
    assert not stale_root["dead ipc"].exists() and not stale_root["dead metrics"].exists()
    assert stale_root["live ipc"].exists() and stale_root["live metrics"].exists()
    # the server's own directories record it as their owner
    pid = server.proc.pid
    for label in ("IPC directory", "metrics directory"):
        path = re.search(rf"{label}: (\S+)", server.logs()).group(1)
        assert os.path.basename(path).split("-")[2] == str(pid), path


# ---- impossible KV sizes ----
@pytest.mark.parametrize(
    "flags",
    [("--max-total-tokens", str(10**12)), ("--mem-fraction-static", "1e-9")],
    ids=["too-large", "too-small"],
)
def test_impossible_kv_size_is_a_one_line_config_error(flags):
    line = config_error_line(*flags)
    assert "--max-total-tokens" in line or "--mem-fraction-static" in line


# ---- graceful shutdown ----
DRAIN_SECONDS = 5
IN_FLIGHT = 60
LONG_TOKENS = 500  # far more than the drain lets finish (and 30 of them fit the KV pool): cut
SHORT_TOKENS = 4


def run_client(url: str, i: int, stream: bool, results: list, first_event: threading.Semaphore) -> None:
    body = {
        "prompt": f"Request {i}: tell me a story.",
        "max_tokens": LONG_TOKENS if i % 4 < 2 else SHORT_TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }
    try:
        if not stream:
            r = httpx.post(url, json=body, timeout=180)
            results[i] = ("plain", r.status_code, r.json())
            return
        lines: list[str] = []
        with httpx.stream("POST", url, json=body, timeout=180) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 1:
                        first_event.release()
            results[i] = ("stream", r.status_code, lines)
    except Exception as e:  # noqa: BLE001 - recorded and asserted below
        results[i] = ("transport error", None, repr(e))


def test_sigterm_drains_then_ends_every_request_cleanly():
    handle = launch_server("--graceful-shutdown-timeout", str(DRAIN_SECONDS))
    try:
        url = f"{handle.openai_base_url}/completions"
        results: list = [None] * IN_FLIGHT
        first_event = threading.Semaphore(0)
        threads = [
            threading.Thread(target=run_client, args=(url, i, i % 2 == 1, results, first_event), daemon=True)
            for i in range(IN_FLIGHT)
        ]
        for t in threads:
            t.start()
        for _ in range(IN_FLIGHT // 2):  # every stream has begun: all 60 requests are in the server
            assert first_event.acquire(timeout=240), "streams never started"
        handle.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)
        try:  # a new request during the drain: refused, never a 500 or a hang
            late = httpx.get(f"{handle.openai_base_url}/models", timeout=5).status_code
        except httpx.TransportError:
            late = None
        assert late in (None, 503)
        for t in threads:
            t.join(DRAIN_SECONDS + 60)
        assert handle.proc.wait(60) == 0
        print(f"SIGTERM to exit: {time.monotonic() - signalled:.1f} s")

        cut = 0
        for i, (kind, status, payload) in enumerate(results):
            assert kind != "transport error", f"request {i}: {payload}"
            if kind == "plain":
                assert status in (200, 503), (i, status, payload)
                if status == 503:
                    assert payload["error"]["type"] == "service_unavailable"
                    cut += 1
                else:
                    assert payload["choices"][0]["finish_reason"] == "length"
            else:
                assert status == 200 and payload[-1] == "data: [DONE]", (i, payload[-3:])
                errors = [line for line in payload if '"error"' in line]
                if errors:
                    assert errors == [payload[-2]], payload[-3:]
                    cut += 1
        log = handle.logs()
        print(f"{cut} of {IN_FLIGHT} requests were cut after the {DRAIN_SECONDS} s drain")
        assert cut >= IN_FLIGHT // 4  # the long ones
        assert "Traceback" not in log and "non-socket" not in log and "Cancel " not in log, log[-3000:]
    finally:
        handle.stop(signal.SIGKILL)
        handle.log_path.unlink(missing_ok=True)
