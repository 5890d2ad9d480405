"""Loading a tokenizer without torch, for the processes that only tokenize and detokenize: from a Hugging
Face directory, or from a GGUF file's own tokenizer metadata (`gguf_metadata.gguf_tokenizer`: no converted
directory, nothing cached)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator

from srt.gguf_metadata import gguf_tokenizer
from srt.heap import release_free_heap
from srt.model_source import is_gguf_file

ADVISORY_WARNINGS_ENV = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def load_tokenizer(path: str):
    """The tokenizer of a Hugging Face directory (`AutoTokenizer.from_pretrained`) or of a `.gguf` file
    (built from its metadata), keeping torch out of a process that has not loaded it yet.

    Why: transformers imports torch whenever it is installed, and torch's libraries then stay resident
    (about 240 MB) in processes that only tokenize and detokenize (the HTTP process, the detokenizer).
    Without torch, transformers still loads tokenizers ("only tokenizers, configuration and file/data
    utilities"). The block is lifted afterwards, so a later `import torch` (an optional grammar backend's)
    still works."""
    with _without_torch():
        if is_gguf_file(path):
            tokenizer = gguf_tokenizer(path)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
    # Building it freed a lot (a GGUF's vocabulary as Python lists, derived merges: Gemma 3's 262k tokens
    # left 513 MB resident, 182 MB once handed back), which the children's heap settings (heap.py) would
    # otherwise keep for the process's life.
    gc.collect()
    release_free_heap()
    return tokenizer


@contextlib.contextmanager
def _without_torch() -> Iterator[None]:
    hide = "torch" not in sys.modules
    # transformers' first import would warn that PyTorch was not found: true here, and meant
    quiet = hide and "transformers" not in sys.modules and ADVISORY_WARNINGS_ENV not in os.environ
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # the import system's "not importable"
    if quiet:
        os.environ[ADVISORY_WARNINGS_ENV] = "1"
    try:
        yield
    finally:
        if hide and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
        if quiet:
            del os.environ[ADVISORY_WARNINGS_ENV]
