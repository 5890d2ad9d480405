"""Builds srt's CPU kernel library from its C sources (`cpu_*_kernels.c`), once per version of the sources,
compiler, flags and CPU, into the srt cache; and reads the exported functions' prototypes from the sources.

Why C and ctypes rather than a torch C++ extension: the sources are plain C without torch's headers, so
they build in about a second with the system compiler (torch extensions take a minute), for this very CPU
(`-march=native`). The library links OpenMP by the same soname as torch's bundled runtime, which is already
loaded, so both share one thread pool. `cpu_kernels.py` loads the library and calls it.
"""

from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import time

from srt.model_executor.layers.c_abi import Prototype, parse_prototypes
from srt.model_source import cache_root

_HERE = os.path.dirname(__file__)
# What the library is compiled from: every `cpu_*_kernels.c` beside this module, with the header, which is part
# of what a cached library was built from. The wheel carries them as package data by the same patterns
# (pyproject.toml: `*.c`, `*.h`), and test_kernel_sources_packaged.py checks a built wheel against this list.
SOURCE_PATTERN = "cpu_*_kernels.c"
HEADER_NAMES = ("cpu_kernels_common.h",)
# The sources the default CPU path cannot run without: one missing is a broken install, reported at start-up
# naming the file (a warning and a PyTorch fallback would hide it behind a slower server).
REQUIRED_SOURCE_NAMES = (
    "cpu_int8_linear_kernels.c",
    "cpu_layer_kernels.c",
    "cpu_attention_kernels.c",
    "cpu_decode_kernels.c",
    "cpu_gguf_kernels.c",  # the decode loop calls srt_gguf_linear
    "cpu_sampling_kernels.c",
)


class KernelSourceMissing(RuntimeError):
    """A C source or header the kernel library is built from is not installed."""


@functools.cache
def sources() -> tuple[str, ...]:
    """The C sources to compile, in a stable order; KernelSourceMissing names a required one that is absent
    (checked when the library is first built or loaded, so the scheduler's start-up reports it)."""
    found = {os.path.basename(p) for p in glob.glob(os.path.join(_HERE, SOURCE_PATTERN))}
    for name in REQUIRED_SOURCE_NAMES + HEADER_NAMES:
        if not os.path.isfile(os.path.join(_HERE, name)):
            raise KernelSourceMissing(
                f"srt's CPU kernel source {name} is missing from {_HERE}: the installation is incomplete "
                "(reinstall srt)"
            )
    return tuple(os.path.join(_HERE, name) for name in sorted(found | set(REQUIRED_SOURCE_NAMES)))


HEADERS = tuple(os.path.join(_HERE, name) for name in HEADER_NAMES)
COMPILER_ENV = "CC"
DEFAULT_COMPILER = "cc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120
LOCK_SUFFIX = ".lock"
# present where an NVIDIA driver is loaded: `--device auto` then means CUDA, and the CPU kernels wait
NVIDIA_CONTROL_DEVICE = "/dev/nvidiactl"


@functools.cache
def prototypes() -> dict[str, Prototype]:
    """Every exported kernel's signature, from the sources the library is built from."""
    text = []
    for name in HEADERS + sources():
        with open(name) as f:
            text.append(f.read())
    found = parse_prototypes("\n".join(text))
    if not found:
        raise ValueError(f"no srt_* prototypes found in {sources() + HEADERS}")
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
    for name in sources() + HEADERS:
        with open(name, "rb") as f:
            h.update(f.read())
    h.update(repr(flags).encode())
    h.update(_compiler_version(cc).encode())
    h.update(_cpu_signature().encode())
    return os.path.join(cache_root(), "kernels", f"cpu_kernels-{h.hexdigest()[:16]}.so")


def build(cc: str | None = None, flags: tuple[str, ...] = FLAGS) -> str:
    """Compile the library unless these sources, compiler, flag set and CPU already have one; its path.

    Each source compiles in a compiler process of its own, all at once, then one link: on a cold start the
    sources take ~6 s one after another on a 2-core CPU, about half side by side. Concurrent builders (the
    tensor-parallel ranks, data-parallel replicas) take turns on a lock file, so the second finds the first's
    library instead of compiling again; the library is written under a temporary name and renamed, so no
    reader ever loads a half-written file."""
    cc = cc or os.environ.get(COMPILER_ENV) or DEFAULT_COMPILER
    path = library_path(cc, flags)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + LOCK_SUFFIX, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(path):  # another builder's, made while this one waited
            _compile(cc, flags, path)
    return path


def _compile(cc: str, flags: tuple[str, ...], path: str) -> None:
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        compile_flags = tuple(f for f in flags if f != "-shared")
        objects, procs = [], []
        for source in sources():
            obj = os.path.join(tmp, os.path.basename(source) + ".o")
            objects.append(obj)
            cmd = [cc, *compile_flags, "-c", source, "-o", obj]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        failure = None
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                failure = failure or subprocess.TimeoutExpired(proc.args, BUILD_TIMEOUT_S, stderr=err)
                continue
            if proc.returncode != 0 and failure is None:
                failure = subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        if failure is not None:
            raise failure
        library = os.path.join(tmp, "library.so")
        subprocess.run(
            [cc, *flags, *objects, "-o", library, "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=True,
        )
        os.replace(library, path)


def build_in_background(device: str) -> threading.Thread | None:
    """Start the build in a thread of the launcher, before its children start: the compilers then run while
    the scheduler imports torch and opens the model, and the scheduler's own `build()` finds the library
    (or waits on the lock for the rest of it). A cold start's compile was most of its excess over a restart.
    Errors are left to the scheduler, which reports them. None where the CPU kernels are not wanted (a GPU
    device, or `auto` on a machine with an NVIDIA driver, or not x86-64)."""
    wanted = device == "cpu" or (device == "auto" and not os.path.exists(NVIDIA_CONTROL_DEVICE))
    if not wanted or platform.machine() not in ("x86_64", "AMD64"):
        return None

    def run() -> None:
        try:
            build()
        except (OSError, subprocess.SubprocessError, RuntimeError):
            pass  # the scheduler's build() meets the same error and reports it

    thread = threading.Thread(target=run, name="kernel-build", daemon=True)
    thread.start()
    return thread
