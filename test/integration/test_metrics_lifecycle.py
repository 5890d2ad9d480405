"""The metrics directory's lifecycle with a real server (docs/metrics.md, "The metrics directory's
lifecycle"): stale files in a user-provided directory never leak into /metrics, a restart on the same
directory starts at 0, clean shutdown removes the run's directory, and a killed scheduler's live gauges go
with it."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from srt.metrics.text_format import parse_metrics_text, select, total
from test.integration.conftest import ServerHandle, launch_server
from test.integration.test_metrics_workload import MODEL, STARTUP_TIMEOUT, metrics_text

pytestmark = pytest.mark.slow

STALE_REQUESTS = 12345
SERVER_ARGS = ["--max-total-tokens", "4096"]
EXIT_TIMEOUT = 30.0

STALE_WRITER = f"""
    from prometheus_client import Counter, Gauge
    Counter("sglang:num_requests", "d", ["model_name"]).labels(model_name="{MODEL}").inc({STALE_REQUESTS})
    Gauge("sglang:num_running_reqs", "d", ["model_name", "tp_rank"], multiprocess_mode="livemostrecent").labels(
        model_name="{MODEL}", tp_rank="0").set(77)
"""


def one_request(server: ServerHandle) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})  # fmt: skip
    r.raise_for_status()


def run_dirs(parent) -> list[str]:
    return glob.glob(os.path.join(parent, "srt-metrics-*"))


@pytest.fixture
def user_dir(tmp_path):
    """A PROMETHEUS_MULTIPROC_DIR the user set, holding a previous run's files."""
    d = tmp_path / "prom"
    d.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d)}
    subprocess.run([sys.executable, "-c", textwrap.dedent(STALE_WRITER)], env=env, check=True, timeout=60)
    assert glob.glob(str(d / "*.db"))
    return d


def test_stale_files_ignored_restart_starts_at_zero_and_shutdown_cleans_up(user_dir):
    env = {"PROMETHEUS_MULTIPROC_DIR": str(user_dir)}
    for _run in range(2):
        server = launch_server(*SERVER_ARGS, timeout=STARTUP_TIMEOUT, env=env)
        try:
            try:
                before = parse_metrics_text(metrics_text(server))
                assert total(before, "sglang:num_requests_total") == 0, "no earlier run's counter leaks in"
                assert [s.value for s in select(before, "sglang:num_running_reqs")] == [0.0]
                assert len(run_dirs(user_dir)) == 1
                one_request(server)
                assert total(parse_metrics_text(metrics_text(server)), "sglang:num_requests_total") == 1
            finally:
                code = server.stop(timeout=EXIT_TIMEOUT)
            assert code == 0
            assert run_dirs(user_dir) == [], "clean shutdown removes the run's directory"
            assert "holds 2 .db file(s) from an earlier run" in server.logs()
        finally:
            server.log_path.unlink(missing_ok=True)
    assert len(glob.glob(str(user_dir / "*.db"))) == 2, "the user's own files are left alone"


def scheduler_pid(metrics_dir: str) -> int:
    """The pid whose live-gauge file holds the scheduler's gauges."""
    for path in glob.glob(os.path.join(metrics_dir, "gauge_livemostrecent_*.db")):
        with open(path, "rb") as f:
            if b"sglang:num_running_reqs" in f.read():
                return int(path.rsplit("_", 1)[1][: -len(".db")])
    raise AssertionError("no scheduler gauge file")


def test_killed_scheduler_takes_its_live_gauges_and_the_server_down(tmp_path):
    parent = tmp_path / "prom"
    parent.mkdir()
    server = launch_server(
        *SERVER_ARGS, timeout=STARTUP_TIMEOUT, env={"PROMETHEUS_MULTIPROC_DIR": str(parent)}
    )
    try:
        (metrics_dir,) = run_dirs(parent)
        pid = scheduler_pid(metrics_dir)
        os.kill(pid, signal.SIGKILL)
        # Once the server reports the death (/health unhealthy), any scrape it still answers must not show
        # the dead scheduler's gauges.
        deadline = time.monotonic() + EXIT_TIMEOUT
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.base_url}/health", timeout=2).status_code != 200:
                    samples = parse_metrics_text(metrics_text(server))
                    assert select(samples, "sglang:num_running_reqs") == []
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert server.proc.wait(EXIT_TIMEOUT) != 0, "a dead child makes the whole server exit non-zero"
        assert not os.path.exists(metrics_dir)
    finally:
        server.stop(timeout=EXIT_TIMEOUT)
        server.log_path.unlink(missing_ok=True)
