"""Each running request's tokens (prompt + output) as one int32 numpy array, kept up to date incrementally.

A lookup proposer searches a request's whole history every step; converting a Python list of a few thousand
ids to an array costs more than the search itself (about 30 ns a token), so the array is built once when a
request is first seen and then only the tokens accepted since the last step are appended. Capacity doubles,
so appends are amortized O(new tokens).
"""

from __future__ import annotations

import numpy as np

from srt.speculative.proposer import SpecRequest

TOKEN_DTYPE = np.int32  # vocabularies stay far below 2**31; half the bytes of int64 to scan


class _History:
    __slots__ = ("buffer", "length", "prompt_len")

    def __init__(self, req: SpecRequest):
        self.prompt_len = len(req.origin_input_ids)
        self.length = self.prompt_len + len(req.output_ids)
        self.buffer = np.empty(max(2 * self.length, 1), dtype=TOKEN_DTYPE)
        self.buffer[: self.prompt_len] = req.origin_input_ids
        self.buffer[self.prompt_len : self.length] = req.output_ids

    def append_output(self, output_ids: list[int]) -> None:
        new = output_ids[self.length - self.prompt_len :]
        end = self.length + len(new)
        if end > len(self.buffer):
            grown = np.empty(2 * end, dtype=TOKEN_DTYPE)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        self.buffer[self.length : end] = new
        self.length = end


class TokenHistories:
    """Per `rid`, a view of the request's tokens. The view is valid until the next `get` for that request."""

    def __init__(self) -> None:
        self._by_rid: dict[str, _History] = {}

    def get(self, req: SpecRequest) -> np.ndarray:
        history = self._by_rid.get(req.rid)
        total = len(req.origin_input_ids) + len(req.output_ids)
        if history is None or history.prompt_len != len(req.origin_input_ids) or history.length > total:
            # First sight, or not the request the entry was built from (its tokens never shrink): rebuild.
            history = self._by_rid[req.rid] = _History(req)
        elif history.length < total:
            history.append_output(req.output_ids)
        return history.buffer[: history.length]

    def release(self, rid: str) -> None:
        self._by_rid.pop(rid, None)

    def __len__(self) -> int:
        return len(self._by_rid)
