"""Where models come from and which attention backend runs them: directories pass through, GGUF files are
converted once per (file, size, mtime) under a lock, and the main process can resolve all this without
importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from srt import model_source
from srt.model_executor.attention import registry
from srt.server_args import ATTENTION_BACKENDS


def test_a_directory_is_used_as_is(tmp_path):
    assert model_source.resolve_model_dir(str(tmp_path)) == str(tmp_path)


def test_a_path_that_is_neither_dir_nor_gguf_is_rejected(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(FileNotFoundError):
        model_source.resolve_model_dir(str(other))


def test_default_is_the_embedded_gguf():
    path = model_source.default_gguf_path()
    assert path.endswith(model_source.EMBEDDED_GGUF_NAME) and os.path.isfile(path)


def test_cache_key_changes_when_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv(model_source.CACHE_DIR_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"a" * 10)
    first = model_source.converted_dir_for(str(gguf))
    assert first.startswith(str(tmp_path / "cache"))
    gguf.write_bytes(b"a" * 11)
    assert model_source.converted_dir_for(str(gguf)) != first


def test_concurrent_resolves_convert_once(tmp_path, monkeypatch):
    monkeypatch.setenv(model_source.CACHE_DIR_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    calls = []

    def fake_convert(src: str, dst: str) -> None:
        calls.append(src)
        time.sleep(0.2)  # long enough for the other thread to reach the lock
        os.makedirs(dst)
        open(os.path.join(dst, model_source.CONVERTED_MARKER), "w").close()

    monkeypatch.setattr(model_source, "_convert_in_subprocess", fake_convert)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(model_source.resolve_model_dir(str(gguf))))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and model_source.is_converted(results[0])


def test_main_process_modules_do_not_import_torch():
    code = (
        "import sys, srt.model_source, srt.model_executor.attention.registry as r;"
        "r.default_backend_name('cpu'); assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_backend_registry_matches_the_cli_choices():
    assert registry.BACKEND_NAMES == ATTENTION_BACKENDS


def test_cpu_defaults_to_torch_native_and_refuses_the_gpu_backends(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert registry.default_backend_name("cpu") == "torch_native"
    with pytest.raises(ValueError, match="CUDA"):
        registry.resolve_backend_name("flashinfer", "cpu")
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        registry.resolve_backend_name("triton", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        registry.resolve_backend_name("flash_attn", "cpu")


def test_flashinfer_backend_module_imports_without_flashinfer():
    cls = registry.backend_class("flashinfer")
    assert cls.__name__ == "FlashInferAttnBackend"
