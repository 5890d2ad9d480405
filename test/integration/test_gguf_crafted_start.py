"""A hostile GGUF given to `python -m srt.launch_server --model-path`: each crafted file
is exit 2 with one `start-up failed:` line naming the problem, no traceback, never a crash in a kernel, a
hang or unbounded memory. The files are a tiny random Llama (scripts/make_random_gguf.py) patched with
struct, as the unit table does (test/unit/test_gguf_file.py) for the parser alone."""

from __future__ import annotations

import re

import pytest

from test.integration.conftest import config_error_line
from test.unit.test_gguf_file import Crafted
from test.unit.test_make_random_gguf import script

pytestmark = pytest.mark.slow

VOCAB = 49152  # SmolLM2's, which the random files carry
SHORT_EMBEDDING = VOCAB - 32

# (id, patch of the valid file's bytes, pattern the start-up line must match)
CASES = [
    ("truncated", lambda c: c.data[: len(c.data) // 2], r"passes the end of the file"),
    ("tensor-count-past-end", lambda c: c.put(8, "Q", 10**6), r"truncated file: 1000000 tensor records"),
    (
        "unknown-block-type",
        lambda c: c.put(c.tensor_type("blk.0.attn_q.weight"), "I", 4),
        r"unknown ggml type 4",
    ),
    (
        "shape-overflow",
        lambda c: c.put(c.tensor_dims("blk.1.ffn_up.weight") + 12, "Q", 1 << 62),
        r"blk\.1\.ffn_up\.weight.*more elements than an int64",
    ),
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("crafted") / "tiny.gguf"
    script("make_random_gguf").write_random_gguf(str(path), "tiny", "q4_0")
    return path.read_bytes()


@pytest.mark.parametrize("patch,pattern", [pytest.param(p, m, id=i) for i, p, m in CASES])
def test_a_crafted_gguf_is_one_start_up_line_naming_the_problem(tiny_gguf, tmp_path, patch, pattern):
    crafted = patch(Crafted(tiny_gguf))
    path = tmp_path / "crafted.gguf"
    path.write_bytes(crafted.data if isinstance(crafted, Crafted) else crafted)
    line = config_error_line("--model-path", str(path))
    assert re.search(pattern, line), line


def test_a_vocabulary_larger_than_the_embedding_is_one_start_up_line(tmp_path):
    """Token ids past the embedding's rows would index outside it: refused before any kernel runs."""
    path = tmp_path / "short-embedding.gguf"
    script("make_random_gguf").write_random_gguf(str(path), "tiny", "q4_0", embedding_rows=SHORT_EMBEDDING)
    line = config_error_line("--model-path", str(path))
    assert re.search(r"(?i)vocab", line) and str(SHORT_EMBEDDING) in line, line
