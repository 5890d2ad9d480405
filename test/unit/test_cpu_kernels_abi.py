"""The CPU kernels' C ABI is declared once, by the C sources: cpu_kernels.py types every exported `srt_*`
function from its prototype at load, refuses a prototype or a C type it cannot read, and a call with the
wrong number of arguments raises instead of reaching the C function."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from srt.model_executor.layers import cpu_kernel_build, cpu_kernels
from srt.model_executor.layers.c_abi import Prototype, bind, parse_prototypes

P, I64 = ctypes.c_void_p, ctypes.c_int64


def source_text() -> str:
    text = []
    for name in cpu_kernel_build.HEADERS + cpu_kernel_build.sources():
        with open(name) as f:
            text.append(f.read())
    return "\n".join(text)


def test_prototypes_map_c_types_to_ctypes():
    text = """
    /* srt_decoy(int a) in a comment is not a prototype */
    #include <stdint.h>
    static inline float srt_helper(v8f x) { return x[0]; }  // not exported: skipped, its type unmapped
    int srt_count(void) { return srt_helper(0); }
    void *srt_pointer(const float *restrict x, int8_t q[], int64_t n,
                      float scale, int flag, double d, size_t len, int32_t i);
    void srt_unnamed(int64_t, const void *);
    """
    found = parse_prototypes(re.sub(r"(?m)^    ", "", text))
    assert found == {
        "srt_count": Prototype("srt_count", ctypes.c_int, ()),
        "srt_pointer": Prototype(
            "srt_pointer",
            P,
            (P, P, I64, ctypes.c_float, ctypes.c_int, ctypes.c_double, ctypes.c_size_t, ctypes.c_int32),
        ),
        "srt_unnamed": Prototype("srt_unnamed", None, (I64, P)),
    }


def test_a_c_type_without_a_ctypes_mapping_raises_naming_it():
    with pytest.raises(ValueError, match=r"srt_x: C type 'uint8_t' has no ctypes mapping"):
        parse_prototypes("void srt_x(const float *x, uint8_t flag) {}")
    with pytest.raises(ValueError, match=r"srt_y: C type 'unsigned long' has no ctypes mapping"):
        parse_prototypes("unsigned long srt_y(void);")


def test_a_prototype_it_cannot_read_raises_rather_than_going_unbound():
    with pytest.raises(ValueError, match=r"cannot read the prototypes of \['srt_x'\]"):
        parse_prototypes("void\nsrt_x(const float *x, int64_t n) {}")
    with pytest.raises(ValueError, match="unsupported parameter"):
        parse_prototypes("void srt_x(void (*callback)(int), int64_t n);")
    with pytest.raises(ValueError, match="srt_x: declared twice with different signatures"):
        parse_prototypes("void srt_x(int64_t n);\nvoid srt_x(int n) {}")


def test_every_exported_function_of_the_sources_is_typed_and_the_library_exports_just_those():
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("srt's CPU kernels do not load here")
    protos = cpu_kernel_build.prototypes()
    assert protos == parse_prototypes(source_text())
    assert {"srt_w8a8_linear", "srt_rmsnorm", "srt_rope", "srt_store_kv", "srt_decode_attention"} <= set(
        protos
    )
    # ctypes declared by hand once read: argtypes and restype as the prototypes give them
    rmsnorm = kernels.function("srt_rmsnorm")
    assert rmsnorm.argtypes == (P, I64, I64, I64, P, ctypes.c_float, P) and rmsnorm.restype is None
    assert kernels.function("srt_decode_attention").restype is ctypes.c_int
    assert kernels.function("srt_store_kv").argtypes[-1] is ctypes.c_int
    with pytest.raises(KeyError):
        kernels.function("srt_no_such_kernel")
    if shutil.which("nm") is None:
        pytest.skip("no nm to list the library's symbols")
    listing = subprocess.run(
        ["nm", "-D", "--defined-only", kernels.path], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in listing.splitlines() if re.search(r" T srt_\w+$", line)}
    assert exported == set(protos)


def test_an_argument_added_or_dropped_on_the_c_side_makes_the_old_call_raise():
    """The Python call of srt_rmsnorm passes 7 arguments. Were its C prototype given one more, or one
    fewer, the binding follows the C and the 7-argument call is a TypeError before any C runs (a plain
    ctypes function would pass a missing argument's register as garbage, or an extra one silently)."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("srt's CPU kernels do not load here")
    text = source_text()
    current = re.search(r"^void srt_rmsnorm\([^)]*\)", text, re.M).group(0)
    lib = ctypes.CDLL(kernels.path)
    call = (0, 0, 0, 0, 0, 1e-5, 0)  # never reaches C: m = 0 would be a no-op anyway
    assert len(current.split(",")) == len(call)
    for edited, message in (
        (current.replace("float eps,", "float eps, int64_t extra,"), "takes 8 arguments"),
        (current.replace("int64_t x_stride, ", ""), "takes 6 arguments"),
    ):
        proto = parse_prototypes(text.replace(current, edited))["srt_rmsnorm"]
        with pytest.raises(TypeError, match=message):
            bind(lib, proto)(*call)
    # a changed type is followed: the binding converts to what the C now takes
    proto = parse_prototypes(text.replace(current, current.replace("float eps", "double eps")))["srt_rmsnorm"]
    assert bind(lib, proto).argtypes[5] is ctypes.c_double
    # and the current prototype binds the 7-argument call, which runs (m = 0 rows: nothing read or written)
    kernels.function("srt_rmsnorm")(*call)
