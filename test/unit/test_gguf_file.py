"""srt's GGUF reader: the embedded files read as gguf-py reads them, and every malformed header or tensor
table a hostile file can hold is one GGUFError naming the problem, raised before anything is allocated
for it (a table of crafted files: GGUFWriter's output, patched with struct)."""

from __future__ import annotations

import os
import stat
import struct
import time
import tracemalloc
import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from srt.model_executor import gguf_file
from srt.model_executor.gguf_file import GGUFError, GGUFFile

ALIGNMENT = 32
Q8_ROWS, Q8_COLS = 4, 64
# a crafted file's parse may allocate no more than this (Python heap, tracemalloc): the table's counts and
# lengths claim up to 2**62 items or bytes
PARSE_HEAP_LIMIT = 1 << 20


def write_base(path) -> tuple[np.ndarray, np.ndarray]:
    """A small valid GGUF: scalar, string and array keys, an F32 vector and a Q8_0 matrix."""
    rng = np.random.default_rng(0)
    vector = np.arange(64, dtype=np.float32)
    matrix = gguf.quants.quantize(rng.standard_normal((Q8_ROWS, Q8_COLS)).astype(np.float32), T.Q8_0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(ALIGNMENT)
    w.add_uint32("test.k1", 7)
    w.add_uint32("test.k2", 8)
    w.add_string("test.name", "hello")
    w.add_array("test.words", ["alpha", "beta", "gamma"])
    w.add_array("test.ints", [1, 2, 3])
    w.add_tensor("tensor.a", vector)
    w.add_tensor("tensor.b", matrix, raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return vector, matrix


class Crafted:
    """Byte positions in a GGUFWriter file, found by their length-prefixed names, and patches to them."""

    def __init__(self, data: bytes):
        self.data = bytearray(data)

    def _named(self, name: str) -> int:
        raw = name.encode()
        return self.data.index(struct.pack("<Q", len(raw)) + raw)

    def key(self, name: str) -> int:
        """Position of the key's length prefix."""
        return self._named(name)

    def key_type(self, name: str) -> int:
        return self._named(name) + 8 + len(name)

    def value(self, name: str) -> int:
        return self.key_type(name) + 4

    def tensor_dims(self, name: str) -> int:
        """Position of the tensor's n_dims field; dims follow, then its type and offset."""
        return self._named(name) + 8 + len(name)

    def tensor_type(self, name: str) -> int:
        p = self.tensor_dims(name)
        return p + 4 + 8 * struct.unpack_from("<I", self.data, p)[0]

    def tensor_offset(self, name: str) -> int:
        return self.tensor_type(name) + 4

    def put(self, pos: int, fmt: str, value) -> Crafted:
        struct.pack_into("<" + fmt, self.data, pos, value)
        return self

    def get(self, pos: int, fmt: str):
        return struct.unpack_from("<" + fmt, self.data, pos)[0]

    def rename(self, old: str, new: str) -> Crafted:
        assert len(old) == len(new)
        p = self._named(old) + 8
        self.data[p : p + len(old)] = new.encode()
        return self


HUGE = 1 << 62
NEG_64 = (1 << 64) - 64  # -64 as a uint64

# (id, patch, message): one per way a file can be malformed; patch takes and returns a Crafted or bytes
CASES = [
    ("short-file", lambda c: c.data[:3], "shorter than the magic"),
    ("bad-magic", lambda c: c.put(0, "4s", b"GGML"), "not a GGUF file: magic"),
    ("version-1", lambda c: c.put(4, "I", 1), "GGUF version 1 is not supported"),
    ("big-endian", lambda c: c.put(4, "I", 3 << 24), "big-endian"),
    ("truncated-header", lambda c: c.data[:60], "truncated file"),
    ("truncated-data", lambda c: c.data[:-100], "passes the end of the file"),  # inside tensor.b's 272 bytes
    ("tensor-count-past-end", lambda c: c.put(8, "Q", 100_000), "truncated file: 100000 tensor records"),
    (
        "tensor-count-huge",
        lambda c: c.put(8, "Q", HUGE),
        "tensor count 4611686018427387904 exceeds the limit",
    ),
    ("kv-count-past-end", lambda c: c.put(16, "Q", 60_000), "truncated file: 60000 key/value records"),
    (
        "kv-count-huge",
        lambda c: c.put(16, "Q", HUGE),
        "key/value count 4611686018427387904 exceeds the limit",
    ),
    ("key-length-past-end", lambda c: c.put(c.key("test.k1"), "Q", HUGE), "truncated file: a metadata key"),
    (
        "string-length-past-end",
        lambda c: c.put(c.value("test.name"), "Q", HUGE),
        "the value of key 'test.name'",
    ),
    (
        "array-length-past-end",
        lambda c: c.put(c.value("test.words") + 4, "Q", 1_000_000),
        "array 'test.words' of 1000000",
    ),
    (
        "array-length-huge",
        lambda c: c.put(c.value("test.ints") + 4, "Q", HUGE),
        "limit of 4194304 metadata items",
    ),
    (
        "array-item-past-end",
        lambda c: c.put(c.value("test.words") + 12, "Q", HUGE),
        "item 0 of array 'test.words'",
    ),
    (
        "unknown-value-type",
        lambda c: c.put(c.key_type("test.k1"), "I", 13),
        "'test.k1' has unknown value type 13",
    ),
    (
        "unknown-array-type",
        lambda c: c.put(c.value("test.ints"), "I", 99),
        "'test.ints' has unknown item type 99",
    ),
    ("nested-array", lambda c: c.put(c.value("test.ints"), "I", 9), "nested arrays are not supported"),
    ("key-not-utf8", lambda c: c.put(c.key("test.k1") + 8, "B", 0xFF), "not UTF-8"),
    ("duplicate-key", lambda c: c.rename("test.k2", "test.k1"), "duplicate metadata key 'test.k1'"),
    (
        "alignment-not-power-of-two",
        lambda c: c.put(c.value("general.alignment"), "I", 48),
        "not a power of two",
    ),
    (
        "alignment-not-an-integer",
        lambda c: c.put(c.key_type("general.alignment"), "I", 6),  # its uint32 read as a float32
        "general.alignment must be a positive integer",
    ),
    (
        "unknown-ggml-type",
        lambda c: c.put(c.tensor_type("tensor.b"), "I", 4),
        "'tensor.b' has unknown ggml type 4",
    ),
    (
        "huge-ggml-type",
        lambda c: c.put(c.tensor_type("tensor.b"), "I", 1 << 31),
        "unknown ggml type 2147483648",
    ),
    (
        "offset-past-end",
        lambda c: c.put(c.tensor_offset("tensor.b"), "Q", 1 << 20),
        "passes the end of the file",
    ),
    ("offset-overflows", lambda c: c.put(c.tensor_offset("tensor.b"), "Q", (1 << 64) - 32), "passes the end"),
    (
        "misaligned-offset",
        lambda c: c.put(c.tensor_offset("tensor.b"), "Q", 8),
        "offset 8 is not a multiple of",
    ),
    ("zero-dim", lambda c: c.put(c.tensor_dims("tensor.b") + 12, "Q", 0), "has dimension 0"),
    ("negative-dim", lambda c: c.put(c.tensor_dims("tensor.b") + 12, "Q", NEG_64), "has dimension -64"),
    (
        "element-count-overflow",
        lambda c: c.put(c.tensor_dims("tensor.b") + 4, "Q", 1 << 32).put(
            c.tensor_dims("tensor.b") + 12, "Q", 1 << 32
        ),
        "more elements than an int64",
    ),
    ("five-dims", lambda c: c.put(c.tensor_dims("tensor.b"), "I", 5), "5 dimensions, more than the 4"),
    ("row-not-whole-blocks", lambda c: c.put(c.tensor_dims("tensor.b") + 4, "Q", 48), "rows of 48 values"),
    ("duplicate-tensor", lambda c: c.rename("tensor.b", "tensor.a"), "duplicate tensor name 'tensor.a'"),
    ("overlapping-tensors", lambda c: c.put(c.tensor_offset("tensor.b"), "Q", 0), "overlap"),
]


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "base.gguf"
    vector, matrix = write_base(path)
    return path, vector, matrix


def test_the_base_file_reads_back_what_was_written(base_file):
    path, vector, matrix = base_file
    f = GGUFFile.open(str(path))
    assert f.version == 3
    assert f.metadata == {
        "general.architecture": "llama",
        "general.alignment": ALIGNMENT,
        "test.k1": 7,
        "test.k2": 8,
        "test.name": "hello",
        "test.words": ["alpha", "beta", "gamma"],
        "test.ints": [1, 2, 3],
    }
    a, b = f.tensors["tensor.a"], f.tensors["tensor.b"]
    assert (a.ggml_type, a.shape, a.nbytes) == (T.F32, (64,), 256)
    assert (b.ggml_type, b.shape, b.nbytes) == (T.Q8_0, (Q8_ROWS, Q8_COLS), matrix.nbytes)
    assert a.offset % ALIGNMENT == 0 and b.offset % ALIGNMENT == 0
    assert torch.equal(f.raw("tensor.a").view(torch.float32), torch.from_numpy(vector))
    assert f.raw("tensor.b").shape == (Q8_ROWS, matrix.shape[1])
    assert np.array_equal(f.raw("tensor.b").numpy(), matrix)


def test_a_v2_file_reads_as_its_v3_twin(base_file, tmp_path):
    path = tmp_path / "v2.gguf"
    path.write_bytes(Crafted(base_file[0].read_bytes()).put(4, "I", 2).data)
    v2, v3 = GGUFFile.open(str(path)), GGUFFile.open(str(base_file[0]))
    assert (v2.version, v2.metadata, v2.tensors) == (2, v3.metadata, v3.tensors)


@pytest.mark.parametrize("patch,message", [pytest.param(p, m, id=i) for i, p, m in CASES])
def test_a_malformed_file_is_one_gguf_error_naming_the_problem(base_file, tmp_path, patch, message):
    crafted = patch(Crafted(base_file[0].read_bytes()))
    path = tmp_path / "crafted.gguf"
    path.write_bytes(crafted.data if isinstance(crafted, Crafted) else crafted)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError) as e:
            GGUFFile.open(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    assert peak < PARSE_HEAP_LIMIT, f"parsing allocated {peak} bytes before refusing the file"


def test_every_problem_case_differs_from_the_valid_file(base_file):
    """A patch that changed nothing would make its case vacuous."""
    original = base_file[0].read_bytes()
    for case_id, patch, _ in CASES:
        crafted = patch(Crafted(original))
        assert bytes(crafted.data if isinstance(crafted, Crafted) else crafted) != original, case_id


def test_a_header_past_the_metadata_limit_is_refused_as_such(base_file, monkeypatch):
    monkeypatch.setattr(gguf_file, "MAX_METADATA_BYTES", 64)
    with pytest.raises(GGUFError, match="64-byte limit"):
        GGUFFile.open(str(base_file[0]))


def test_a_tensor_name_longer_than_ggml_allows_is_refused(tmp_path):
    """llama.cpp keeps names in 64-byte buffers (with the NUL): a longer one is no file it would load."""
    path = tmp_path / "long-name.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("x" * 64, np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        GGUFError, match="a tensor name at byte .* is 64 bytes long, more than the 63 allowed"
    ):
        GGUFFile.open(str(path))


def test_a_zero_tensor_file_is_valid(tmp_path):
    path = tmp_path / "vocab-only.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile.open(str(path))
    assert f.tensors == {} and f.metadata["tokenizer.ggml.tokens"] == ["a", "b"]


def test_raw_views_one_private_map_of_the_file_without_copying(base_file, tmp_path):
    path = tmp_path / "readonly.gguf"
    path.write_bytes(base_file[0].read_bytes())
    os.chmod(path, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)  # a wheel's file may be read-only
    f = GGUFFile.open(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a, b = f.raw("tensor.a"), f.raw("tensor.b")
    ta, tb = f.tensors["tensor.a"], f.tensors["tensor.b"]
    # both views of one storage (the whole file), each at its own offset: nothing was copied
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() == os.path.getsize(path)
    assert b.data_ptr() - a.data_ptr() == tb.offset - ta.offset
    assert b.is_contiguous() and b.dtype == torch.uint8
    before = path.read_bytes()
    b[0, 0] ^= 0xFF  # a stray write stays in this process's private copy of the page
    assert path.read_bytes() == before


def embedded(name: str) -> str:
    from srt.model_source import embedded_gguf_path

    try:
        return embedded_gguf_path(name)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_the_embedded_files_read_as_gguf_py_reads_them_and_faster(name):
    """Every key and every tensor (name, type, shape, offset, bytes) agree with gguf-py's reader, which
    this parser must beat by a wide margin: its string-array loop is what makes a start fast."""
    path = embedded(name)
    start = time.perf_counter()
    reference = gguf.GGUFReader(path)
    keys = [k for k in reference.fields if not k.startswith("GGUF.")]
    values = {k: reference.fields[k].contents() for k in keys}
    theirs = time.perf_counter() - start
    start = time.perf_counter()
    f = GGUFFile.open(path)
    ours = time.perf_counter() - start
    assert list(f.metadata) == keys
    assert f.metadata == values
    assert list(f.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        mine = f.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type)
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert (mine.offset, mine.nbytes) == (t.data_offset, t.n_bytes)
        assert np.array_equal(f.raw(t.name).numpy().reshape(-1), t.data.reshape(-1).view(np.uint8))
    assert ours * 10 < theirs, f"srt parsed {name} in {ours:.2f} s, gguf-py in {theirs:.2f} s"
