"""Builds srt's CPU kernel library from its C sources (`cpu_*_kernels.c`), once per version of the sources,
compiler, flags and CPU, into the srt cache; and reads the exported functions' prototypes from the sources.

Why C and ctypes rather than a torch C++ extension: the sources are plain C without torch's headers, so
they build in seconds with the system compiler (torch extensions take a minute), for this very CPU
(`-march=native`). The library links OpenMP by the same soname as torch's bundled runtime, which is already
loaded, so both share one thread pool. `cpu_kernels.py` loads the library and calls it.

Two builds of the same sources, both with every kernel: the library (`build()`), which every path loads,
and the one for the block products (`build(block_products=True)`), which the `gguf` method's layers run
(`gguf_linear.kernels()`, `LayerMethods.for_run`). They differ only in how the GGUF source is optimized
(`DEQUANTIZE_OPT`): the library's GGUF code only dequantizes (the weights' rounding at load under
`gguf_int8`, a block-format embedding), which -O2 compiles in half the time of -O3 and runs no slower, and
that compile is most of what a cold start waits for on 2 cores. Each source compiles into an object of its
own, cached by what it is built from, so the second library compiles one source, not six.
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
OPTIMIZE_FLAG = "-O3"
# The GGUF source's optimization in the library every path loads, where only its dequantization runs. -O2
# against -O3 (scripts/bench_gguf_gemm.py's shapes, one thread, CPU-time medians, on the 2-core Xeon
# with AVX-512 VNNI): dequantized rows 10-50 % faster (Q4_1 1536 x 768: 0.33 against 0.64 ms), the compile
# 1.6 s of CPU against 3.5; but one token's block products up to 35 % slower (Q5_K 2048 x 2048: 0.33 against
# 0.24 ms), so the block-product library keeps -O3. The other sources lose 10-80 % at -O2 (attention most):
# they keep -O3 in both.
DEQUANTIZE_OPT = "-O2"
BLOCK_SOURCE_NAME = "cpu_gguf_kernels.c"
# the method whose layers run the block products (quantization.GGUF_QUANTIZATION: this module is also the
# launcher's, which imports no torch)
BLOCK_PRODUCTS_QUANTIZATION = "gguf"
BUILD_TIMEOUT_S = 120
LOCK_SUFFIX = ".lock"
OBJECTS_DIR = "objects"
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


def _key(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
    return h.hexdigest()[:16]


def _read(name: str) -> bytes:
    with open(name, "rb") as f:
        return f.read()


def source_flags(source: str, flags: tuple[str, ...], block_products: bool) -> tuple[str, ...]:
    """The compile flags of one source (no `-shared`): `flags`, with the GGUF source at DEQUANTIZE_OPT in the
    library that only dequantizes blocks."""
    compile_flags = tuple(f for f in flags if f != "-shared")
    if block_products or os.path.basename(source) != BLOCK_SOURCE_NAME:
        return compile_flags
    return tuple(DEQUANTIZE_OPT if f == OPTIMIZE_FLAG else f for f in compile_flags)


def _objects(cc: str, flags: tuple[str, ...], block_products: bool) -> list[tuple[str, str, tuple[str, ...]]]:
    """(source, cached object path, its compile flags) for every source: an object's name covers its source,
    the header, its flags, the compiler's version and the CPU, so the two libraries share five of six."""
    toolchain = _compiler_version(cc) + _cpu_signature()
    headers = b"".join(_read(h) for h in HEADERS)
    root = os.path.join(cache_root(), "kernels", OBJECTS_DIR)
    found = []
    for source in sources():
        sflags = source_flags(source, flags, block_products)
        key = _key(_read(source), headers, repr(sflags), toolchain)
        found.append((source, os.path.join(root, f"{os.path.basename(source)}-{key}.o"), sflags))
    return found


def _library_path(objects: list[tuple[str, str, tuple[str, ...]]], flags: tuple[str, ...]) -> str:
    key = _key(*(obj for _, obj, _ in objects), repr(flags))
    return os.path.join(cache_root(), "kernels", f"cpu_kernels-{key}.so")


def build(cc: str | None = None, flags: tuple[str, ...] = FLAGS, block_products: bool = False) -> str:
    """Compile the library (with `block_products`, the block products' one: see the module's docstring)
    unless these sources, compiler, flag set and CPU already have one; its path.

    Each source compiles in a compiler process of its own, all at once, into a cached object, then one link.
    Concurrent builders (the tensor-parallel ranks, data-parallel replicas) take turns on a lock file, so the
    second finds the first's library instead of compiling again; every file is written under a temporary name
    and renamed, so no reader ever loads a half-written one."""
    cc = cc or os.environ.get(COMPILER_ENV) or DEFAULT_COMPILER
    objects = _objects(cc, flags, block_products)
    path = _library_path(objects, flags)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(objects[0][1]), exist_ok=True)
    with open(path + LOCK_SUFFIX, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(path):  # another builder's, made while this one waited
            _compile(cc, objects)
            _link(cc, flags, [obj for _, obj, _ in objects], path)
    return path


def _compile(cc: str, objects: list[tuple[str, str, tuple[str, ...]]]) -> None:
    """Compile the objects not in the cache yet, each in its own compiler process, all at once."""
    missing = [(src, obj, f) for src, obj, f in objects if not os.path.isfile(obj)]
    if not missing:
        return
    with tempfile.TemporaryDirectory(dir=os.path.dirname(missing[0][1])) as tmp:
        procs = []
        for source, obj, sflags in missing:
            out = os.path.join(tmp, os.path.basename(obj))
            cmd = [cc, *sflags, "-c", source, "-o", out]
            procs.append(
                (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out, obj)
            )
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        failure = None
        for proc, out, obj in procs:
            try:
                _, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                failure = failure or subprocess.TimeoutExpired(proc.args, BUILD_TIMEOUT_S, stderr=err)
                continue
            if proc.returncode != 0:
                failure = failure or subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
            else:
                os.replace(out, obj)
        if failure is not None:
            raise failure


def _link(cc: str, flags: tuple[str, ...], objects: list[str], path: str) -> None:
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        library = os.path.join(tmp, "library.so")
        subprocess.run(
            [cc, *flags, *objects, "-o", library, "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=True,
        )
        os.replace(library, path)


def build_in_background(device: str, quantization: str | None = None) -> threading.Thread | None:
    """Start the build in a thread of the launcher, before its children start: the compilers then run while
    the scheduler imports torch and opens the model, and the scheduler's own `build()` finds the library
    (or waits on the lock for the rest of it). A cold start's compile was most of its excess over a restart.
    It builds the library the start loads: the block products' under `--quantization gguf` (then the other,
    which dequantizes), else the one every path loads. A GGUF left to the size rule (`gguf_int8.gguf_method`,
    which the launcher cannot run without importing torch) gets the latter, which the embedded models run;
    a larger file's `gguf` scheduler compiles the GGUF source once more itself. Errors are left to the
    scheduler, which reports them. None where the CPU kernels are not wanted (a GPU device, or `auto` on a
    machine with an NVIDIA driver, or not x86-64)."""
    wanted = device == "cpu" or (device == "auto" and not os.path.exists(NVIDIA_CONTROL_DEVICE))
    if not wanted or platform.machine() not in ("x86_64", "AMD64"):
        return None
    builds = [True, False] if quantization == BLOCK_PRODUCTS_QUANTIZATION else [False]

    def run() -> None:
        try:
            for block_products in builds:
                build(block_products=block_products)
        except (OSError, subprocess.SubprocessError, RuntimeError):
            pass  # the scheduler's build() meets the same error and reports it

    thread = threading.Thread(target=run, name="kernel-build", daemon=True)
    thread.start()
    return thread
