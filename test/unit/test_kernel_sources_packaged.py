"""The wheel is the product: every C source and header the CPU kernel library is compiled from at run time is in
the built wheel, and a missing one is a start-up error naming the file, never a warning and a slower server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import zipfile

import pytest

from srt.model_executor.layers import cpu_kernel_build, cpu_kernels
from srt.model_source import CACHE_DIR_ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS_IN_WHEEL = "srt/model_executor/layers/"


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """The file names of a wheel built from the tracked tree (copied, so the build leaves nothing here)."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    files = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, files):
        dst = tree / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(REPO, rel), dst)
    out = tmp / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(tree),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("srt-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


@pytest.mark.slow
def test_the_wheel_carries_every_source_the_kernel_build_compiles(wheel_names):
    needed = {
        LAYERS_IN_WHEEL + os.path.basename(p) for p in cpu_kernel_build.sources() + cpu_kernel_build.HEADERS
    }
    assert needed <= wheel_names, f"missing from the wheel: {sorted(needed - wheel_names)}"


@pytest.mark.slow
def test_the_wheel_carries_the_runtime_data_files(wheel_names):
    assert "srt/model_executor/calibration_text.txt" in wheel_names


@pytest.mark.slow
def test_the_wheel_holds_the_runtime_alone(wheel_names):
    """The benchmarks' and tests' tooling (scripts/srt_bench: load generator, peers, server launcher) is no
    part of the product: the wheel holds srt and its metadata, and no benchmark module."""
    tops = {name.split("/", 1)[0] for name in wheel_names}
    assert all(top == "srt" or top.endswith(".dist-info") for top in tops), sorted(tops)
    assert not [name for name in wheel_names if "bench" in name]


def test_a_missing_required_source_is_an_error_naming_it(monkeypatch):
    monkeypatch.setattr(
        cpu_kernel_build,
        "REQUIRED_SOURCE_NAMES",
        (*cpu_kernel_build.REQUIRED_SOURCE_NAMES, "cpu_gone_kernels.c"),
    )
    cpu_kernel_build.sources.cache_clear()
    try:
        with pytest.raises(cpu_kernel_build.KernelSourceMissing, match="cpu_gone_kernels.c"):
            cpu_kernel_build.sources()
        # the loader does not turn it into a warning and a PyTorch fallback: it reaches start-up
        cpu_kernels.load.cache_clear()
        with pytest.raises(cpu_kernel_build.KernelSourceMissing, match="cpu_gone_kernels.c"):
            cpu_kernels.load()
    finally:
        monkeypatch.undo()
        cpu_kernel_build.sources.cache_clear()
        cpu_kernels.load.cache_clear()  # the next caller builds (or finds) the real library again


def test_every_kernel_source_beside_the_build_is_compiled():
    here = os.path.dirname(cpu_kernel_build.__file__)
    on_disk = {n for n in os.listdir(here) if n.startswith("cpu_") and n.endswith("_kernels.c")}
    assert on_disk == {os.path.basename(p) for p in cpu_kernel_build.sources()}


def test_concurrent_builders_compile_once_and_share_the_library(tmp_path, monkeypatch):
    """Tensor-parallel ranks and data-parallel replicas start together: the first compiles, the others wait
    on the lock and load its library."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    compiled = []
    real = cpu_kernel_build._compile

    def counting(cc, objects):
        compiled.append([obj for _, obj, _ in objects])
        real(cc, objects)

    monkeypatch.setattr(cpu_kernel_build, "_compile", counting)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(cpu_kernel_build.build())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiled) == 1 and len(set(paths)) == 1 and os.path.isfile(paths[0])
    kernels_dir = os.path.dirname(paths[0])
    assert sorted(os.listdir(kernels_dir)) == sorted(
        [
            os.path.basename(paths[0]),
            os.path.basename(paths[0]) + cpu_kernel_build.LOCK_SUFFIX,
            cpu_kernel_build.OBJECTS_DIR,
        ]
    )  # no temporary libraries left behind ...
    objects = os.listdir(os.path.join(kernels_dir, cpu_kernel_build.OBJECTS_DIR))
    assert sorted(objects) == sorted(os.path.basename(obj) for obj in compiled[0])  # ... nor objects
