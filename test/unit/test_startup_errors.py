"""Start-up errors are one clear line and exit code 2 (a crash is 1), before anything heavy starts; the
open-files limit is raised; temp directories left by a killed launcher are removed at the next start."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import resource
import socket
import subprocess
import sys
import time

import pytest

from srt.child_startup import (
    EXIT_CHILD_FAILED,
    EXIT_CONFIG_ERROR,
    ConfigError,
    StartupFailure,
    run_child,
    startup_failure,
)
from srt.owned_dirs import make_owned_temp_dir, remove_stale_dirs
from srt.process_control import process_start_time, raise_fd_limit
from srt.sockets import bind_listener

# None of these loads a model: each must fail in about the time the interpreter takes to start.
FAST_FAIL_SECONDS = 30.0
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def launch(*flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    base = {k: v for k, v in os.environ.items() if k != MULTIPROC_ENV}
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "srt.launch_server", *flags],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r, time.monotonic() - start


def assert_one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == EXIT_CONFIG_ERROR, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    lines = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, r.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_only_dir(tmp_path) -> str:
    """A directory this process cannot create anything in (root ignores permission bits, not sysfs)."""
    if os.geteuid() == 0:
        return "/sys/kernel"
    d = tmp_path / "ro"
    d.mkdir(mode=0o555)
    return str(d)


# ---- bad values fail fast, in one line ----
def test_port_already_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r, took = launch("--port", str(port))
    line = assert_one_line_error(r, "already in use", str(port), "--port")
    assert took < FAST_FAIL_SECONDS, line


@pytest.mark.parametrize("kind", ["read-only", "a file", "cannot be created"])
def test_unusable_metrics_dir(kind, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    value = {
        "read-only": read_only_dir(tmp_path),
        "a file": str(a_file),
        "cannot be created": str(a_file / "sub"),
    }[kind]
    r, took = launch("--port", str(free_port()), env={MULTIPROC_ENV: value})
    assert_one_line_error(r, MULTIPROC_ENV, value, "unset it")
    assert took < FAST_FAIL_SECONDS


def test_missing_model_path(tmp_path):
    r, took = launch("--port", str(free_port()), "--model-path", str(tmp_path / "nope"))
    assert_one_line_error(r, "--model-path", "does not exist")
    assert took < FAST_FAIL_SECONDS


@pytest.mark.parametrize(
    "flags",
    [
        ("--max-request-bytes", "0"),
        ("--graceful-shutdown-timeout", "-1"),
        ("--max-concurrent-requests", "0"),
        ("--speculative-algorithm", "STANDALONE"),  # without --speculative-draft-model-path
    ],
)
def test_bad_new_flags(flags):
    r, _ = launch(*flags)
    assert_one_line_error(r, flags[0])


def test_bind_listener_reports_a_bad_host():
    with pytest.raises(ConfigError, match="--host"):
        bind_listener("192.0.2.1", free_port())  # TEST-NET-1: never a local address


# ---- child start-up failures ----
@pytest.mark.parametrize(
    "exc, config",
    [
        (ValueError("--tp-size 3 does not divide this model's num_attention_heads=9"), True),
        (
            RuntimeError(
                "KV pool would hold only 3 tokens (1 bytes at 46080 bytes/token); raise "
                "--mem-fraction-static or set --max-total-tokens"
            ),
            True,
        ),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                "tried to allocate 8000000000000 bytes. Error code 12 (Cannot allocate memory)"
            ),
            True,
        ),
        (MemoryError(), True),
        (ConfigError("bad value: change --x"), True),
        (RuntimeError("boom\nsecond line"), False),
        (KeyError("weights"), False),
    ],
)
def test_startup_failure_classification(exc, config):
    failure = startup_failure(exc)
    assert failure.config_error is config
    assert "\n" not in failure.message and failure.message
    if "allocate" in str(exc):
        assert "tried to allocate 8000000000000 bytes" in failure.message
        assert "--max-total-tokens" in failure.message
    assert type(exc).__name__ in failure.detail


def _fails_like_the_scheduler(label: str, ready_writer) -> None:
    """A child entry point that reports its traceback as a string and re-raises, as the scheduler does."""
    try:
        raise RuntimeError("KV pool would hold only 3 tokens; raise --mem-fraction-static")
    except Exception:
        import traceback

        ready_writer.send(traceback.format_exc())
        raise


def test_child_failure_before_ready_is_one_classified_line_without_traceback(capfd):
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=run_child, args=("srt-test", __name__, "_fails_like_the_scheduler", "x", writer)
    )
    proc.start()
    writer.close()
    assert reader.poll(60)
    msg = reader.recv()
    proc.join(30)
    assert isinstance(msg, StartupFailure) and msg.config_error
    assert "--mem-fraction-static" in msg.message and "Traceback" in msg.detail
    assert proc.exitcode == EXIT_CHILD_FAILED
    assert "Traceback" not in capfd.readouterr().err


# ---- file descriptors ----
def test_fd_soft_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"hard open-files limit is only {hard}")
    code = "from srt.process_control import raise_fd_limit; import resource; print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"(1024, {hard}) ({hard}, {hard})"
    assert raise_fd_limit()[1] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---- stale temp directories ----
def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_dirs_of_dead_owners_are_removed_and_live_ones_kept(tmp_path):
    me, my_start = os.getpid(), process_start_time(os.getpid())
    dead = tmp_path / f"srt-ipc-{dead_pid()}-12345-abcd1234"
    reused = tmp_path / f"srt-ipc-{me}-{my_start + 1}-abcd1234"  # this pid, another process's start time
    live = tmp_path / f"srt-ipc-{me}-{my_start}-abcd1234"
    legacy = tmp_path / "srt-ipc-abcd1234"  # records no owner: left alone
    other = tmp_path / f"srt-metrics-{dead_pid()}-1-abcd1234"  # another prefix: not this call's business
    for d in (dead, reused, live, legacy, other):
        d.mkdir()
        (d / "scheduler").write_text("")
    removed = remove_stale_dirs("srt-ipc-", str(tmp_path))
    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert not dead.exists() and not reused.exists()
    assert live.exists() and legacy.exists() and other.exists()


def test_owned_dir_names_record_this_process(tmp_path):
    d = make_owned_temp_dir("srt-metrics-", str(tmp_path))
    name = os.path.basename(d)
    assert re.fullmatch(rf"srt-metrics-{os.getpid()}-{process_start_time(os.getpid())}-[^-]+", name)
    assert remove_stale_dirs("srt-metrics-", str(tmp_path)) == []  # its owner (this process) is alive
