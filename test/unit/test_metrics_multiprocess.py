"""PROMETHEUS_MULTIPROC_DIR lifecycle (docs/metrics.md, "The metrics directory's lifecycle"). Each case runs
in a fresh interpreter: whether prometheus_client is imported, and the environment, are per-process facts."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ENV = "PROMETHEUS_MULTIPROC_DIR"


def run(code: str, env_dir: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if env_dir is not None:
        env[ENV] = env_dir
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_multiprocess_module_does_not_import_prometheus_client():
    r = run("import sys, srt.metrics.multiprocess, srt.metrics.request_stats, srt.metrics.stat_logger, "
            "srt.metrics.text_format; print('prometheus_client' in sys.modules)")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_check_raises_loudly_when_prometheus_client_came_first():
    r = run("""
        import prometheus_client
        from srt.metrics.multiprocess import setup_multiprocess_dir
        setup_multiprocess_dir()
    """)
    assert r.returncode != 0
    assert "RuntimeError" in r.stderr and "PROMETHEUS_MULTIPROC_DIR" in r.stderr


def test_fresh_temp_dir_is_created_used_and_removed(tmp_path):
    r = run("""
        import json, os
        from srt.metrics.multiprocess import setup_multiprocess_dir, cleanup_multiprocess_dir
        d = setup_multiprocess_dir()
        from prometheus_client import Counter
        Counter("c", "doc").inc()
        files = sorted(os.listdir(d))
        cleanup_multiprocess_dir()
        print(json.dumps({"dir": d, "env": os.environ["PROMETHEUS_MULTIPROC_DIR"], "files": files,
                          "exists_after": os.path.exists(d)}))
    """)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dir"] == out["env"]
    assert len(out["files"]) == 1 and re.fullmatch(
        r"counter_\d+\.db", out["files"][0]
    )  # values went to files
    assert not out["exists_after"]


def test_user_dir_with_stale_files_gets_fresh_subdir_and_warning(tmp_path):
    stale = tmp_path / "counter_12345.db"
    stale.write_bytes(b"\0" * 16)
    r = run("""
        import json, logging, os
        logging.basicConfig(level=logging.WARNING)
        from srt.metrics.multiprocess import setup_multiprocess_dir, cleanup_multiprocess_dir
        d = setup_multiprocess_dir()
        print(json.dumps({"dir": d, "env": os.environ["PROMETHEUS_MULTIPROC_DIR"]}))
        cleanup_multiprocess_dir()
    """, env_dir=str(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert os.path.dirname(out["dir"]) == str(tmp_path)
    assert out["env"] == out["dir"]
    assert "counter_12345.db" in r.stderr and "WARNING" in r.stderr
    assert stale.exists(), "the user's directory and files are never removed"
    assert not os.path.exists(out["dir"])


def test_clean_user_dir_gets_no_warning(tmp_path):
    r = run("""
        import logging
        logging.basicConfig(level=logging.WARNING)
        from srt.metrics.multiprocess import setup_multiprocess_dir
        setup_multiprocess_dir()
    """, env_dir=str(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "WARNING" not in r.stderr


@pytest.mark.parametrize("runs", [2])
def test_two_runs_never_share_a_directory(runs):
    dirs = set()
    for _ in range(runs):
        r = run("from srt.metrics.multiprocess import setup_multiprocess_dir as s, cleanup_multiprocess_dir as c;"
                "print(s()); c()")  # fmt: skip
        assert r.returncode == 0, r.stderr
        dirs.add(r.stdout.strip())
    assert len(dirs) == runs
