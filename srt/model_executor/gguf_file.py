"""A validating reader for GGUF files (v2 and v3), which srt treats as untrusted input.

A GGUF is a header (magic, version, tensor and key counts), key/value metadata, one info record per
tensor (name, dims, ggml type, offset) and, aligned to `general.alignment`, the tensor data. Every count
and length in it is checked against the bytes that remain before anything is allocated for it, and the
metadata as a whole is capped (`MAX_METADATA_BYTES`, `MAX_METADATA_ITEMS`), so a hostile header can make
`GGUFFile.open` raise a one-line `GGUFError` but never allocate without bound, hang, or hand a C kernel a
tensor that runs past the file. gguf-py's `GGUFReader` trusts its input (it slices whatever the header
says) and takes seconds to parse a 49k-token vocabulary; this one reads a string array in one tight loop.

Tensor data is never read here: `raw` returns a uint8 view of a private memory map of the file, so only
the pages a kernel touches become resident, and they are the page cache's. The module imports torch only
in `raw`, so that reading a file's metadata stays cheap.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
ALIGNMENT_KEY = "general.alignment"
DEFAULT_ALIGNMENT = 32  # GGUF's alignment when the file has no `general.alignment`
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml tensors have at most four dimensions
MAX_TENSOR_NAME_BYTES = 63  # GGML_MAX_NAME (64) less the terminating NUL: llama.cpp refuses longer names
INT64_MAX = (1 << 63) - 1
# The header (metadata and tensor infos) must end within this many bytes: real ones are a few MB (Gemma 3's
# 262k-token vocabulary: 6.5 MB), and it bounds what a hostile header can make the parser copy into memory.
MAX_METADATA_BYTES = 1 << 28
# Python objects the metadata may create (array items, all arrays together): 16x Gemma 3's three 262k-entry
# vocabulary arrays. A uint8 array of N bytes becomes N Python ints (~36 bytes each): this bounds that.
MAX_METADATA_ITEMS = 1 << 22
MAX_KEYS = 1 << 16  # key/value pairs (real files: a few dozen)
MAX_TENSORS = 1 << 20  # tensor infos (a 1,000-expert model stores its experts as 3-D tensors: a few thousand)

# GGUF value types (gguf.GGUFValueType): the fixed-size scalars by their struct code
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_STRING_LEN_BYTES = _U64.size
# smallest encodings: a key/value (empty key, uint8 value) and a tensor info (empty name, no dims)
_MIN_KV_BYTES = _U64.size + _U32.size + 1
_MIN_TENSOR_INFO_BYTES = _U64.size + _U32.size + _U32.size + _U64.size


class GGUFError(ValueError):
    """A malformed or unsupported GGUF: one line naming the problem (the tensor, key or byte offset)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # torch order (GGUF's dims reversed): a 2-D weight is (out_features, in_features)
    offset: int  # absolute byte offset of its data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the innermost dimension); the whole tensor for a 0-d one."""
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        return self.shape[-1] // block_size * type_size if self.shape else type_size


@dataclass
class GGUFFile:
    """A parsed and validated GGUF: `metadata` (key -> int | float | bool | str | list, in file order) and
    `tensors` (name -> GGUFTensor, in file order). Every tensor lies inside the file, aligned, with a shape
    whose innermost dimension is whole blocks of its type, and no two tensors overlap."""

    path: str
    version: int
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]
    file_size: int
    _storage: torch.UntypedStorage | None = field(
        default=None, init=False, repr=False, compare=False
    )  # the map, once made

    @classmethod
    def open(cls, path: str) -> GGUFFile:
        """Parse and validate the whole header; raises GGUFError (and OSError if the file cannot be read)."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < len(GGUF_MAGIC):
                raise GGUFError(f"not a GGUF file: {size} bytes, shorter than the magic")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _Parser(buf, size).parse(path)

    def raw(self, name: str) -> torch.Tensor:
        """Tensor `name`'s bytes as a uint8 tensor over a private memory map of the file (no copy; writes
        would stay in this process and never reach the file): shape (*shape[:-1], row_bytes), so a 2-D
        weight is (rows, row_bytes) and a 1-D one (nbytes,)."""
        import torch

        t = self.tensors[name]
        if self._storage is None:
            self._storage = torch.UntypedStorage.from_file(self.path, shared=False, nbytes=self.file_size)
        shape = (*t.shape[:-1], t.row_bytes)
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        return torch.empty(0, dtype=torch.uint8).set_(self._storage, t.offset, shape, stride)


class _Parser:
    """One pass over the header, `pos` moving forward; every read checks the bytes left first."""

    def __init__(self, buf: mmap.mmap, size: int):
        self.buf = buf
        self.size = size
        self.end = min(size, MAX_METADATA_BYTES)  # the header must end here
        self.pos = 0
        self.items = 0  # Python objects created for array items so far

    def parse(self, path: str) -> GGUFFile:
        if self.buf[:4] != GGUF_MAGIC:
            raise GGUFError(f"not a GGUF file: magic {bytes(self.buf[:4])!r}, expected {GGUF_MAGIC!r}")
        self.pos = 4
        version = self.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0:
                raise GGUFError("big-endian GGUF files are not supported")
            readable = " and ".join(map(str, SUPPORTED_VERSIONS))
            raise GGUFError(f"GGUF version {version} is not supported (srt reads versions {readable})")
        n_tensors = self.count(self.u64("the tensor count"), _MIN_TENSOR_INFO_BYTES, MAX_TENSORS, "tensor")
        n_keys = self.count(self.u64("the key/value count"), _MIN_KV_BYTES, MAX_KEYS, "key/value")
        metadata: dict[str, object] = {}
        for _ in range(n_keys):
            key = self.string("a metadata key")
            if key in metadata:
                raise GGUFError(f"duplicate metadata key {key!r}")
            metadata[key] = self.value(key, self.u32(f"the type of key {key!r}"))
        alignment = metadata.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise GGUFError(f"{ALIGNMENT_KEY} must be a positive integer, not {alignment!r}")
        if alignment & (alignment - 1):
            raise GGUFError(f"{ALIGNMENT_KEY} {alignment} is not a power of two")
        infos = [self.tensor_info() for _ in range(n_tensors)]
        data_start = -(-self.pos // alignment) * alignment
        tensors: dict[str, GGUFTensor] = {}
        for name, shape, ggml_type, rel_offset in infos:
            if name in tensors:
                raise GGUFError(f"duplicate tensor name {name!r}")
            tensors[name] = self.check_tensor(name, shape, ggml_type, rel_offset, data_start, alignment)
        check_no_overlap(tensors.values())
        return GGUFFile(path, version, metadata, tensors, self.size)

    def fail_short(self, n: int, what: str) -> GGUFError:
        left = self.end - self.pos
        if self.end < self.size:
            return GGUFError(
                f"{what} at byte {self.pos}: {n} bytes more would take the header past its "
                f"{MAX_METADATA_BYTES}-byte limit"
            )
        return GGUFError(f"truncated file: {what} at byte {self.pos}: {n} bytes needed, {left} remain")

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise self.fail_short(n, what)

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def count(self, n: int, min_bytes: int, cap: int, what: str) -> int:
        """`n` records of at least `min_bytes` each must fit in what is left of the header, and stay <= cap."""
        if n > cap:
            raise GGUFError(f"{what} count {n} exceeds the limit of {cap}")
        if n * min_bytes > self.end - self.pos:
            raise self.fail_short(n * min_bytes, f"{n} {what} records")
        return n

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"the length of {what}")
        if limit is not None and n > limit:
            raise GGUFError(f"{what} at byte {self.pos - 8} is {n} bytes long, more than the {limit} allowed")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what} at byte {self.pos - n} is not UTF-8 ({e.reason})") from None

    def value(self, key: str, vtype: int) -> object:
        code = _SCALARS.get(vtype)
        if code is not None:
            size = struct.calcsize(code)
            self.need(size, f"the value of key {key!r}")
            (v,) = struct.unpack_from("<" + code, self.buf, self.pos)
            self.pos += size
            return v
        if vtype == _STRING:
            return self.string(f"the value of key {key!r}")
        if vtype == _ARRAY:
            return self.array(key)
        raise GGUFError(f"key {key!r} has unknown value type {vtype}")

    def array(self, key: str) -> list:
        item_type = self.u32(f"the item type of array {key!r}")
        n = self.u64(f"the length of array {key!r}")
        if item_type == _ARRAY:
            raise GGUFError(f"array {key!r} holds arrays: nested arrays are not supported")
        code = _SCALARS.get(item_type)
        if code is None and item_type != _STRING:
            raise GGUFError(f"array {key!r} has unknown item type {item_type}")
        item_bytes = struct.calcsize(code) if code is not None else _STRING_LEN_BYTES
        self.items += n
        if self.items > MAX_METADATA_ITEMS:
            raise GGUFError(
                f"array {key!r} of {n} items passes the limit of {MAX_METADATA_ITEMS} metadata items"
            )
        self.need(n * item_bytes, f"array {key!r} of {n} items")
        if code is None:
            return self.strings(key, n)
        values = list(struct.unpack_from(f"<{n}{code}", self.buf, self.pos))
        self.pos += n * item_bytes
        return values

    def strings(self, key: str, n: int) -> list[str]:
        """`n` length-prefixed strings: the vocabulary and merges, the hot part of a header (98k strings
        for SmolLM2, 262k for Gemma 3), in one loop with everything it touches held in locals."""
        buf, pos, end = self.buf, self.pos, self.end
        unpack = _U64.unpack_from
        chunks = []
        append = chunks.append
        for i in range(n):
            if pos + 8 > end:
                self.pos = pos
                raise self.fail_short(8, f"the length of item {i} of array {key!r}")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > end - pos:
                self.pos = pos
                raise self.fail_short(length, f"item {i} of array {key!r}")
            append(buf[pos : pos + length])
            pos += length
        self.pos = pos
        try:
            return [c.decode("utf-8") for c in chunks]
        except UnicodeDecodeError as e:
            bad = next(i for i, c in enumerate(chunks) if not _is_utf8(c))
            raise GGUFError(f"item {bad} of array {key!r} is not UTF-8 ({e.reason})") from None

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string("a tensor name", MAX_TENSOR_NAME_BYTES)
        n_dims = self.u32(f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions, more than the {MAX_DIMS} ggml allows")
        dims = [self.u64(f"dimension {i} of tensor {name!r}") for i in range(n_dims)]
        ggml_type = self.u32(f"the type of tensor {name!r}")
        offset = self.u64(f"the offset of tensor {name!r}")
        return name, tuple(reversed(dims)), ggml_type, offset

    def check_tensor(
        self,
        name: str,
        shape: tuple[int, ...],
        ggml_type: int,
        rel_offset: int,
        data_start: int,
        alignment: int,
    ) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {name!r} has unknown ggml type {ggml_type}") from None
        for d in shape:
            if d == 0 or d > INT64_MAX:
                signed = [x - (1 << 64) if x > INT64_MAX else x for x in shape]
                raise GGUFError(
                    f"tensor {name!r} has dimension {signed[shape.index(d)]} in shape {signed}: not positive"
                )
        n_elements = math.prod(shape)
        if n_elements > INT64_MAX:
            raise GGUFError(f"tensor {name!r} shape {list(shape)} has more elements than an int64 holds")
        cols = shape[-1] if shape else 1
        if cols % block_size:
            raise GGUFError(
                f"tensor {name!r} ({qtype.name}) has rows of {cols} values, not a multiple of its "
                f"{block_size}-value block"
            )
        nbytes = n_elements // block_size * type_size
        offset = data_start + rel_offset
        if rel_offset % alignment:
            raise GGUFError(
                f"tensor {name!r} offset {rel_offset} is not a multiple of {ALIGNMENT_KEY} {alignment}"
            )
        if offset + nbytes > self.size:
            raise GGUFError(
                f"tensor {name!r} data [{offset}, {offset + nbytes}) passes the end of the file ({self.size} bytes)"
            )
        return GGUFTensor(name, int(qtype), shape, offset, nbytes)


def check_no_overlap(tensors) -> None:
    previous = None
    for t in sorted(tensors, key=lambda t: t.offset):
        if previous is not None and t.offset < previous.offset + previous.nbytes:
            raise GGUFError(
                f"tensors {previous.name!r} [{previous.offset}, {previous.offset + previous.nbytes}) and "
                f"{t.name!r} [{t.offset}, {t.offset + t.nbytes}) overlap"
            )
        previous = t


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
