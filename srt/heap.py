"""How the server's processes keep (or hand back) freed heap memory."""

from __future__ import annotations

import ctypes
import os

# glibc returns every freed block above the mmap threshold to the kernel, so each forward step's multi-MB
# activations come back as fresh pages and pay a page fault per 4 KiB on first touch (measured on the
# embedded model: batch-1 decode 71 -> 59 ms/step with the heap kept). Children read these at exec.
CHILD_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(8 << 30),
}


def release_free_heap() -> None:
    """Hand the heap's free memory back to the kernel once (glibc's malloc_trim), after a one-time phase that
    freed a lot — the fp32 weights that int8 replaced — which CHILD_MALLOC_ENV would otherwise keep
    resident for the process's life. A no-op where glibc is not the allocator."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def keep_heap_for_children() -> None:
    """Make spawned children (scheduler, detokenizer) keep freed memory in their heap; a value the user set
    wins."""
    for key, value in CHILD_MALLOC_ENV.items():
        os.environ.setdefault(key, value)
