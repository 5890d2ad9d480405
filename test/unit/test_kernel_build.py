"""The kernel build's two libraries (`cpu_kernel_build`): which one each path loads, what the launcher builds,
and that the second library costs one source's compile, not six. The compilers are stood in for here (the
compiled libraries are tested in test_cpu_kernels.py and test_gguf_kernels.py)."""

from __future__ import annotations

import os

import pytest

from srt.model_executor.layers import cpu_kernel_build, cpu_kernels
from srt.model_executor.layers.linear_method import LayerMethods
from srt.model_executor.quantization import GGUF_QUANTIZATION
from srt.model_source import CACHE_DIR_ENV


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path):
    """Stand-ins for the compile and the link, in an empty cache: each compile writes the objects missing
    from the cache and records their sources; each link writes the library."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    compiled: list[list[str]] = []

    def compile_missing(cc, objects):
        missing = [(src, obj) for src, obj, _ in objects if not os.path.isfile(obj)]
        if missing:
            compiled.append(sorted(os.path.basename(src) for src, _ in missing))
        for _, obj in missing:
            with open(obj, "wb") as f:
                f.write(b"object")

    def link(cc, flags, objects, path):
        with open(path, "wb") as f:
            f.write(b"library")

    monkeypatch.setattr(cpu_kernel_build, "_compile", compile_missing)
    monkeypatch.setattr(cpu_kernel_build, "_link", link)
    return compiled


def test_the_block_products_library_compiles_only_the_gguf_source_again(fake_compiler):
    every_source = sorted(os.path.basename(s) for s in cpu_kernel_build.sources())
    library = cpu_kernel_build.build()
    blocks = cpu_kernel_build.build(block_products=True)
    assert library != blocks and os.path.isfile(library) and os.path.isfile(blocks)
    assert fake_compiler == [every_source, [cpu_kernel_build.BLOCK_SOURCE_NAME]]
    assert cpu_kernel_build.build() == library and len(fake_compiler) == 2  # both found in the cache


def test_only_the_gguf_source_is_optimized_differently():
    flags = cpu_kernel_build.FLAGS
    for source in cpu_kernel_build.sources():
        library = cpu_kernel_build.source_flags(source, flags, block_products=False)
        blocks = cpu_kernel_build.source_flags(source, flags, block_products=True)
        assert "-shared" not in library and blocks == tuple(f for f in flags if f != "-shared")
        if os.path.basename(source) == cpu_kernel_build.BLOCK_SOURCE_NAME:
            assert (
                cpu_kernel_build.DEQUANTIZE_OPT in library and cpu_kernel_build.OPTIMIZE_FLAG not in library
            )
        else:
            assert library == blocks


@pytest.mark.parametrize(
    ("quantization", "builds"),
    [
        (GGUF_QUANTIZATION, [{"block_products": True}, {"block_products": False}]),
        # the embedded SmolLM2 (gguf_int8 by its size, which the launcher does not work out)
        (None, [{"block_products": False}]),
        ("gguf_int8", [{"block_products": False}]),
        ("w8a8_int8", [{"block_products": False}]),
        ("none", [{"block_products": False}]),  # the sampler's argmax kernel
    ],
)
def test_the_launcher_builds_what_its_start_loads(monkeypatch, quantization, builds):
    calls = []
    monkeypatch.setattr(cpu_kernel_build, "build", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cpu_kernel_build.platform, "machine", lambda: "x86_64")
    thread = cpu_kernel_build.build_in_background("cpu", quantization)
    thread.join(10)
    assert calls == builds


def test_the_block_products_library_is_the_gguf_methods(monkeypatch):
    assert cpu_kernel_build.BLOCK_PRODUCTS_QUANTIZATION == GGUF_QUANTIZATION
    loaded = []
    monkeypatch.setattr(cpu_kernels, "load", lambda block_products: loaded.append(block_products) or "lib")
    for quantization in ("gguf", "gguf_int8", "w8a8_int8", "none"):
        LayerMethods.for_run(quantization, "cpu")
    assert loaded == [True, False, False]  # none runs no kernels in its layers


def test_each_library_is_loaded_once_however_it_is_asked_for(monkeypatch):
    """Layers, norms and the fused steps compare the kernels they hold with `load()`: asking with the
    keyword must not load (and check) the same library a second time."""
    built = []
    monkeypatch.setattr(
        cpu_kernels, "build", lambda block_products=False: built.append(block_products) or "x"
    )
    monkeypatch.setattr(
        cpu_kernels, "CpuKernels", lambda path: type("K", (), {"isa": "avx2", "path": path})()
    )
    monkeypatch.setattr(cpu_kernels, "agrees_with_torch", lambda kernels: True)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is cpu_kernels.load(block_products=False) is cpu_kernels.load(False)
        assert cpu_kernels.load(block_products=True) is not cpu_kernels.load()
        assert built == [False, True]
    finally:
        cpu_kernels.load.cache_clear()
