"""Host lists of indices -> tensors on the model runner's device, for one step's `ForwardBatch`.

On the CPU a tensor built from the list is already where the model reads it. On CUDA a tensor built from a
list lives in pageable host memory, and copying it to the GPU is synchronous; instead each field has a
pinned staging buffer, reused every step, that is filled on the host and copied with `non_blocking=True`.
Reuse is safe because the next step waits for the last step's copies (one CUDA event) before it writes a
staging buffer again; in practice that copy finished long ago, since sampling reads the logits back.
"""

from __future__ import annotations

import torch

from srt.mem_cache.memory_pool import INDEX_DTYPE

# A staging buffer grows at least this much at a time, so a slowly growing batch re-pins rarely.
STAGING_GROWTH = 2


class IndexUploader:
    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.staged = self.device.type == "cuda"
        self._staging: dict[str, torch.Tensor] = {}
        self._copied = torch.cuda.Event() if self.staged else None
        self._pending = False

    def begin_step(self) -> None:
        """Before the first upload of a step: the previous step's copies must have left the staging buffers."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def end_step(self) -> None:
        if self.staged:
            self._copied.record()
            self._pending = True

    def upload(self, name: str, values: list[int]) -> torch.Tensor:
        """`values` as an int64 tensor on the device; `name` picks the staging buffer (one per field of a
        step: two fields of one step must not share a name)."""
        if not self.staged:
            return torch.tensor(values, dtype=INDEX_DTYPE, device=self.device)
        n = len(values)
        buf = self._staging.get(name)
        if buf is None or buf.numel() < n:
            size = max(n, STAGING_GROWTH * (0 if buf is None else buf.numel()), 1)
            buf = torch.empty(size, dtype=INDEX_DTYPE, pin_memory=True)
            self._staging[name] = buf
        host = buf[:n]
        host.numpy()[:] = values
        return host.to(self.device, non_blocking=True)
