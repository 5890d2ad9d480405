"""Builds srt's CPU kernel library from its C sources (`cpu_*_kernels.c`), once per version of the sources,
compiler, flags and CPU, into the srt cache; and reads the exported functions' prototypes from the sources.

Why C and ctypes rather than a torch C++ extension: the sources are plain C without torch's headers, so
they build in about a second with the system compiler (torch extensions take a minute), for this very CPU
(`-march=native`). The library links OpenMP by the same soname as torch's bundled runtime, which is already
loaded, so both share one thread pool. `cpu_kernels.py` loads the library and calls it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import tempfile

from srt.model_executor.layers.c_abi import Prototype, parse_prototypes
from srt.model_source import cache_root

_HERE = os.path.dirname(__file__)
# compiled together into one library; the header is part of what the cached library was built from
SOURCES = tuple(
    os.path.join(_HERE, name)
    for name in (
        "cpu_int8_linear_kernels.c",
        "cpu_layer_kernels.c",
        "cpu_attention_kernels.c",
        "cpu_decode_kernels.c",
        "cpu_sampling_kernels.c",
    )
)
HEADERS = (os.path.join(_HERE, "cpu_kernels_common.h"),)
COMPILER_ENV = "CC"
DEFAULT_COMPILER = "cc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120


@functools.cache
def prototypes() -> dict[str, Prototype]:
    """Every exported kernel's signature, from the sources the library is built from."""
    text = []
    for name in HEADERS + SOURCES:
        with open(name) as f:
            text.append(f.read())
    found = parse_prototypes("\n".join(text))
    if not found:
        raise ValueError(f"no srt_* prototypes found in {SOURCES + HEADERS}")
    return found


def _compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (a cache shared by machines must not mix)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def library_path(cc: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        with open(name, "rb") as f:
            h.update(f.read())
    h.update(repr(flags).encode())
    h.update(_compiler_version(cc).encode())
    h.update(_cpu_signature().encode())
    return os.path.join(cache_root(), "kernels", f"cpu_kernels-{h.hexdigest()[:16]}.so")


def build(cc: str | None = None, flags: tuple[str, ...] = FLAGS) -> str:
    """Compile the library unless these sources, compiler, flag set and CPU already have one; its path.
    Written under a temporary name and renamed, so concurrent builders (tensor-parallel ranks) never load a
    half-written file."""
    cc = cc or os.environ.get(COMPILER_ENV) or DEFAULT_COMPILER
    path = library_path(cc, flags)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, *SOURCES, "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=True,
        )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
