"""Where models come from and which attention backend runs them: directories pass through, GGUF files are
converted once per (file, size, mtime) under a lock, and the main process can resolve all this without
importing torch."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

import pytest

from srt import model_source
from srt.model_executor.attention import registry
from srt.server_args import ATTENTION_BACKENDS

# how long the lock's holder waits for the other callers to reach it (they start at once: far less)
LOCK_ARRIVAL_TIMEOUT_S = 30.0


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


def count_lock_arrivals(monkeypatch, callers: int):
    """A barrier in place of a sleep: model_source's lock counts who reached it (before waiting on it); the
    returned function waits until all `callers` have, so the one holding the lock knows the others are
    blocked on it."""
    arrived = threading.Condition()
    count = [0]
    real_locked = model_source._locked

    @contextlib.contextmanager
    def counting(path):
        with arrived:
            count[0] += 1
            arrived.notify_all()
        with real_locked(path):
            yield

    monkeypatch.setattr(model_source, "_locked", counting)

    def wait() -> None:
        with arrived:
            assert arrived.wait_for(lambda: count[0] == callers, timeout=LOCK_ARRIVAL_TIMEOUT_S), count[0]

    return wait


def test_concurrent_resolves_convert_once(tmp_path, monkeypatch):
    monkeypatch.setenv(model_source.CACHE_DIR_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    calls = []

    def fake_convert(src: str, dst: str) -> None:
        calls.append(src)
        every_caller_reached_the_lock()  # the others now wait on it: this is the race being tested
        os.makedirs(dst)
        open(os.path.join(dst, model_source.CONVERTED_MARKER), "w").close()

    monkeypatch.setattr(model_source, "_convert_in_subprocess", fake_convert)
    every_caller_reached_the_lock = count_lock_arrivals(monkeypatch, 3)
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


def test_embedded_names_resolve_unless_a_path_of_that_name_exists(tmp_path, monkeypatch):
    assert model_source.embedded_model_name(None) == model_source.DEFAULT_EMBEDDED_MODEL
    assert model_source.embedded_model_name("gemma3-270m") == "gemma3-270m"
    assert model_source.embedded_model_name("no-such-model") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert model_source.embedded_model_name("gemma3-270m") is None  # the directory wins
    assert model_source.resolve_model_dir("gemma3-270m") == "gemma3-270m"


def test_served_names_of_embedded_models(tmp_path):
    from srt.server_args import ServerArgs

    assert ServerArgs().model_name == "SmolLM2-135M-Instruct"
    assert ServerArgs(model_path="gemma3-270m").model_name == "gemma-3-270m"
    gguf = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    assert ServerArgs(model_path=str(gguf)).model_name == "gemma-3-270m-q4_k_m"
    with pytest.raises(ValueError, match="embedded model's name"):
        ServerArgs(model_path="gemma3-27b")


def test_a_chunked_model_is_assembled_once_into_the_cache(tmp_path, monkeypatch):
    """Concurrent first uses join the chunks once (under the lock, by rename), into a file named for the
    wheel's digest; later calls reuse it without calling the wheel's assemble()."""
    monkeypatch.setenv(model_source.CACHE_DIR_ENV, str(tmp_path / "cache"))
    calls = []

    class FakeWheel:
        EXPECTED_SHA256 = "0123456789abcdef" * 4

        @staticmethod
        def assemble(output_path, overwrite=False):
            calls.append(output_path)
            every_caller_reached_the_lock()  # the others now wait on it: this is the race being tested
            with open(output_path, "wb") as f:
                f.write(b"GGUF")
            return output_path

    model = model_source.EmbeddedModel("fake", "srt_test_fake_wheel", "fake-wheel", "fake.gguf", chunked=True)
    monkeypatch.setitem(sys.modules, model.package, FakeWheel)
    every_caller_reached_the_lock = count_lock_arrivals(monkeypatch, 3)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(model_source.assembled_gguf_path(model)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    path = results[0]
    assert path == str(tmp_path / "cache" / "embedded" / "fake-0123456789ab.gguf")
    assert open(path, "rb").read() == b"GGUF"
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp" in n]
    assert model_source.assembled_gguf_path(model) == path and len(calls) == 1


def test_a_missing_wheel_says_what_to_install(monkeypatch):
    model = model_source.EmbeddedModel("x", "srt_no_such_wheel", "no-such-wheel", "x.gguf", chunked=True)
    monkeypatch.setitem(model_source.EMBEDDED_MODELS, "no-such", model)
    with pytest.raises(FileNotFoundError, match="pip install no-such-wheel"):
        model_source.embedded_gguf_path("no-such")


def test_a_gemma3_gguf_gets_the_turn_template_and_end_of_turn_as_an_end_token():
    """What Gemma 3's GGUF lacks for chat is added at conversion; a template the file has is kept, and other
    families are left as they are."""
    from types import SimpleNamespace

    from srt.gguf_metadata import GEMMA3_CHAT_TEMPLATE
    from srt.model_executor import gguf_convert

    class Tokenizer:
        unk_token_id = 3
        chat_template = None

        def convert_tokens_to_ids(self, token):
            return {"<end_of_turn>": 106}.get(token, self.unk_token_id)

    tok, gen = Tokenizer(), SimpleNamespace(eos_token_id=1)
    gguf_convert.add_chat_conventions("gemma3_text", tok, gen)
    assert tok.chat_template == GEMMA3_CHAT_TEMPLATE and gen.eos_token_id == [1, 106]
    gguf_convert.add_chat_conventions("gemma3_text", tok, gen)  # idempotent
    assert gen.eos_token_id == [1, 106]
    tok, gen = Tokenizer(), SimpleNamespace(eos_token_id=[2])
    tok.chat_template = "{{ messages }}"
    gguf_convert.add_chat_conventions("gemma3_text", tok, gen)
    assert tok.chat_template == "{{ messages }}" and gen.eos_token_id == [2, 106]
    tok, gen = Tokenizer(), SimpleNamespace(eos_token_id=2)
    gguf_convert.add_chat_conventions("llama", tok, gen)
    assert tok.chat_template is None and gen.eos_token_id == 2


def test_the_gemma3_template_renders_gemmas_turns():
    from jinja2 import Environment

    from srt.gguf_metadata import GEMMA3_CHAT_TEMPLATE

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = (
        Environment()
        .from_string(GEMMA3_CHAT_TEMPLATE)
        .render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_a_conversion_parses_each_gguf_once_and_restores_gguf_after(tmp_path):
    """transformers opens the file once per part it reads (tokenizer, config, weights, generation config);
    inside `parsed_once` they share one reader and one tensor-name map, and gguf is itself again after."""
    import gguf
    import numpy as np

    from srt.model_executor.gguf_convert import parsed_once

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(os.path.join(str(tmp_path), ".", "tiny.gguf")) is first
        assert first.get_tensor(0).name == "token_embd.weight"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (make_reader, make_map)
    assert gguf.GGUFReader(path) is not first
