"""The dependency and lint rules, enforced: import-linter checks the contracts in .importlinter, ruff the
rules pyproject.toml selects (among them SLF: no module touches another's private attributes)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(lint), "--config", str(ROOT / ".importlinter")], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_lint_rules_hold():
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    proc = subprocess.run(
        [str(ruff), "check", "--no-cache", "srt", "scripts", "test"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
