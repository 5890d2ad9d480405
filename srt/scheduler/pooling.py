"""An embedding server's result (--is-embedding): each prompt's final hidden states pooled into one
L2-normalized vector (--pooling-type), as vLLM's pooling runner does for decoder checkpoints.

A prompt may be prefilled in several chunks (--chunked-prefill-size): each step pools its rows per request
(`pool_rows`: the last row, or the rows' sum), a request keeps what its chunks gave so far (`Req.pooled`), and
the vector is finished once the whole prompt has run (`finish_embedding`). Mean pooling needs every prompt
token's state, so its server never serves a prompt from the prefix cache (Scheduler: no radix cache).

The vector travels as little-endian float32 bytes: what OpenAI's `encoding_format: "base64"` encodes and its
client decodes, a quarter of a pickled list of floats, and exact for `float` after decoding.
"""

from __future__ import annotations

import numpy as np
import torch

from srt.server_args import POOLING_LAST, POOLING_MEAN

# The wire format of a vector: little-endian float32, whatever the host's byte order.
EMBEDDING_DTYPE = np.dtype("<f4")


def needs_every_token(pooling: str) -> bool:
    """Whether the pooling reads every prompt token's state (then no prompt token may come from a cache)."""
    return pooling == POOLING_MEAN


def pool_rows(hidden: torch.Tensor, counts: list[int], pooling: str) -> torch.Tensor:
    """[len(counts), hidden] from a step's final hidden states [sum(counts), hidden], whose rows are the
    requests' new tokens in order (`counts[i]` for request i): each request's last row, or the sum of its
    rows (a mean's numerator, so chunks add up)."""
    sizes = torch.tensor(counts, device=hidden.device)
    if pooling == POOLING_LAST:
        return hidden[sizes.cumsum(0) - 1]
    segment = torch.repeat_interleave(torch.arange(len(counts), device=hidden.device), sizes)
    return torch.zeros(len(counts), hidden.shape[1], dtype=hidden.dtype, device=hidden.device).index_add_(
        0, segment, hidden
    )


def add_chunk(pooled: torch.Tensor | None, rows: torch.Tensor, pooling: str) -> torch.Tensor:
    """A request's pooled state after one more chunk: the newest last row, or the running sum."""
    if pooled is None or pooling == POOLING_LAST:
        return rows
    return pooled + rows


def finish_embedding(pooled: torch.Tensor, num_tokens: int, pooling: str) -> bytes:
    """The request's vector on the wire: its pooled state (divided by its `num_tokens` for a mean)
    L2-normalized, as little-endian float32 bytes."""
    vector = pooled.float() / num_tokens if pooling == POOLING_MEAN else pooled.float()
    vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.cpu().numpy().astype(EMBEDDING_DTYPE).tobytes()
