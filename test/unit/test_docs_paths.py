"""The repository's documents are its own: every `docs/` path that the code, the tests, the scripts or the
README name exists, every relative link in the documents leads to a file, and nothing cites the founding
documents that live outside the repository or the issue tracker's numbers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS_PATH = re.compile(r"(?<![\w/.])docs/[\w./-]*\w/?")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# the founding documents have upper-case names (docs/metrics.md is the repository's own)
OUTSIDE_CITATION = re.compile(r"\.\./shared|\b(?:DESIGN|METRICS|STYLE)\.md|(?i:\bissues? #?\d+\b)")


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def sources() -> list[Path]:
    return tracked("srt", "test", "scripts", "README.md", "docs", ".ci", "pyproject.toml")


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, IsADirectoryError):
        return None


def test_the_finders_find_what_they_look_for():
    assert OUTSIDE_CITATION.search("see ../shared/x") and OUTSIDE_CITATION.search("(Issue 9, part 2)")
    assert OUTSIDE_CITATION.search("METRICS.md says") and not OUTSIDE_CITATION.search("docs/metrics.md says")
    found = DOCS_PATH.findall("see docs/metrics.md, and docs/benchmarks/ (or `docs/cpu_execution.md`).")
    assert found == ["docs/metrics.md", "docs/benchmarks/", "docs/cpu_execution.md"]
    assert MD_LINK.findall("[a](metrics.md#labels) [b](https://x.org) [c](../README.md)") == [
        "metrics.md",
        "https://x.org",
        "../README.md",
    ]


def test_every_docs_path_named_in_the_repository_exists():
    missing = []
    for path in sources():
        text = text_of(path)
        if text is None or path == Path(__file__):
            continue
        for name in set(DOCS_PATH.findall(text)):
            if not (ROOT / name.rstrip(".")).exists():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_every_relative_link_in_the_documents_leads_to_a_file():
    broken = []
    for path in [ROOT / "README.md", *tracked("docs")]:
        text = text_of(path)
        if text is None:
            continue
        for target in MD_LINK.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_nothing_cites_documents_outside_the_repository_or_issue_numbers():
    cited = []
    for path in sources():
        text = text_of(path)
        if text is None or path == Path(__file__):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_CITATION.search(line):
                cited.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not cited, cited
