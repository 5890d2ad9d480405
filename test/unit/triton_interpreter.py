"""Triton kernels under its CPU interpreter, for a test module on a machine without CUDA.

Triton reads TRITON_INTERPRET when a kernel is decorated (at import) and again while interpreting. So a test
module imports its kernels inside `interpreted_imports()` and takes `interpreter_while_testing` (autouse)
for its tests: a session-wide variable would reach every later test and every server they start.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

ENV = "TRITON_INTERPRET"
SET_HERE = not torch.cuda.is_available() and ENV not in os.environ
INTERPRETED = SET_HERE or os.environ.get(ENV) == "1"
# triton 3.6's interpreter holds bf16 as raw 16-bit integers and multiplies those in tl.dot
BF16_UNSUPPORTED = pytest.mark.skipif(INTERPRETED, reason="the Triton interpreter's tl.dot mishandles bf16")


@contextmanager
def interpreted_imports():
    """Imports of kernel modules within this block decorate their kernels for the interpreter (where CUDA is
    absent); a module without triton is skipped."""
    if SET_HERE:
        os.environ[ENV] = "1"
    try:
        pytest.importorskip("triton")
        yield
    finally:
        if SET_HERE:
            del os.environ[ENV]


@pytest.fixture(autouse=True)
def interpreter_while_testing(monkeypatch):
    if INTERPRETED:
        monkeypatch.setenv(ENV, "1")
