"""Loading a tokenizer without torch, for the processes that only tokenize and detokenize."""

from __future__ import annotations

import os
import sys

ADVISORY_WARNINGS_ENV = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def load_tokenizer(path: str):
    """`AutoTokenizer.from_pretrained(path)`, keeping torch out of a process that has not loaded it yet.

    Why: transformers imports torch whenever it is installed, and torch's libraries then stay resident
    (about 240 MB) in processes that only tokenize and detokenize (the HTTP process, the detokenizer).
    Without torch, transformers still loads tokenizers ("only tokenizers, configuration and file/data
    utilities"). The block is lifted afterwards, so a later `import torch` (an optional grammar backend's)
    still works."""
    hide = "torch" not in sys.modules
    # transformers' first import would warn that PyTorch was not found: true here, and meant
    quiet = hide and "transformers" not in sys.modules and ADVISORY_WARNINGS_ENV not in os.environ
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # the import system's "not importable"
    if quiet:
        os.environ[ADVISORY_WARNINGS_ENV] = "1"
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    finally:
        if hide and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
        if quiet:
            del os.environ[ADVISORY_WARNINGS_ENV]
