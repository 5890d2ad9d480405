"""KV memory: the request-to-token table, the KV slot allocator and the per-layer K/V buffers.

Page size is 1: every token owns exactly one KV slot. Slot 0 is never handed out so that padded
positions (e.g. unused tail entries of `req_to_token`) can point at it and write harmlessly.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

# KV slot reserved as the write target of padding; usable slots are 1..size.
PADDING_SLOT = 0
INDEX_DTYPE = torch.int64


class ReqToTokenPool:
    """Maps a request slot (row) to the KV slot index of each of its tokens (columns).

    The scheduler owns the row contents; this pool hands out and takes back rows, and `write` is the table's
    one store (who calls it, and when: docs/architecture.md, "Step layout and the request-to-token table").
    """

    def __init__(self, size: int, max_context_len: int, device: str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=INDEX_DTYPE, device=device)
        self._free_slots: list[int] = list(range(size))

    def alloc(self, n: int = 1) -> list[int] | None:
        """Take `n` free rows, or None (taking nothing) if fewer are free."""
        if n > len(self._free_slots):
            return None
        taken = self._free_slots[:n]
        del self._free_slots[:n]
        return taken

    def free(self, idx: int | list[int]) -> None:
        if isinstance(idx, int):
            self._free_slots.append(idx)
        else:
            self._free_slots.extend(idx)

    def available_size(self) -> int:
        return len(self._free_slots)

    def write(self, index: tuple, slots: torch.Tensor) -> None:
        """From now on the entries `index` selects (a row and a column slice, or a row and a column tensor
        per slot) hold `slots`. Nothing else stores into `req_to_token` (test/unit/test_step_layout.py), so
        the table has one writer to read when a row holds the wrong slots."""
        self.req_to_token[index] = slots

    def clear(self) -> None:
        self._free_slots = list(range(self.size))


class TokenToKVPoolAllocator:
    """Free list of KV slots: a head tensor that `alloc` slices, plus the chunks freed since, which are
    concatenated onto the head only when an `alloc` needs more than the head holds.

    Both operations cost O(slots moved), never O(free list): the scheduler frees every step, and joining
    the whole free list on each free cost O(pool size) per step. Slots come back in the order they were
    freed (fresh slots first, then freed chunks oldest first). `free` copies its argument, so a caller may
    pass a view of a table it later overwrites. Freeing a slot twice is a caller bug that this class does not
    detect (it would cost a bitmap update per call); tests check the callers' accounting instead.
    """

    def __init__(self, size: int, device: str = "cpu"):
        self.size = size
        self.device = device
        self.clear()

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` slots as an int64 tensor, or None (taking nothing) if fewer than `n` are free."""
        if n > self._head.numel():
            if n > self.available_size():
                return None
            self._merge()
        taken = self._head[:n]
        self._head = self._head[n:]
        return taken

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        self._freed.append(indices.to(device=self.device, dtype=INDEX_DTYPE, copy=True))
        self._num_freed += indices.numel()

    def available_size(self) -> int:
        return self._head.numel() + self._num_freed

    def clear(self) -> None:
        self._head = torch.arange(PADDING_SLOT + 1, self.size + 1, dtype=INDEX_DTYPE, device=self.device)
        self._freed: list[torch.Tensor] = []
        self._num_freed = 0

    def _merge(self) -> None:
        self._head = torch.cat((self._head, *self._freed))
        self._freed.clear()
        self._num_freed = 0


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape [size + 1, head_num, head_dim] (row 0 is the padding slot)."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str = "cpu",
    ):
        self.size = size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        shape = (size + 1, head_num, head_dim)
        self.k_buffer = [zeros_on_demand(shape, dtype, device) for _ in range(layer_num)]
        self.v_buffer = [zeros_on_demand(shape, dtype, device) for _ in range(layer_num)]
        logger.info(
            "KV pool: %d slots, %.1f MiB",
            size,
            self.bytes_per_token(dtype, head_num, head_dim, layer_num) * (size + 1) / 2**20,
        )

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write this step's K/V rows at slots `loc` (cache_k/cache_v: [len(loc), head_num, head_dim])."""
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)

    @staticmethod
    def bytes_per_token(dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int) -> int:
        """Bytes one token's K and V take across all layers; used to size the pool from a memory budget."""
        k_and_v = 2
        return k_and_v * head_num * head_dim * layer_num * torch.empty((), dtype=dtype).element_size()


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero tensor whose memory, on the CPU, is committed page by page as it is first written.

    Why: the KV pool is sized for the worst case (10 % of memory by default, gigabytes), while a server
    mostly holds far fewer tokens. `torch.zeros` writes every page at start-up, so the whole pool would be
    resident from the first second; a private anonymous mapping reads as zeros and costs resident memory
    only where K/V has been written. (`torch.empty` would not do: heap memory may hold stale bytes.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor keeps `region` alive; the mapping is released with the tensor's last reference
    return torch.frombuffer(region, dtype=dtype).view(shape)
