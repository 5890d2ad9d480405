"""An input embedding kept in a GGUF's block format: a lookup dequantizes the rows of the tokens asked for.

Why not an fp32 table: SmolLM2's 49k x 576 table is 113 MB in fp32 and 30 MB as Q8_0 blocks (Gemma 3
270M's 262k x 640: 671 MB against 178 MB), and a step looks up a few rows. The blocks are a view of the
file's private map, so only the pages of rows ever looked up become resident. A tied output head multiplies
by the same `BlockMatrix` through its linear method (`ReplicatedLinear` holds no table of its own).
"""

from __future__ import annotations

import torch
from torch import nn

from srt.model_executor.layers.gguf_linear import BlockMatrix, dequantize_rows


class BlockEmbedding(nn.Module):
    """`nn.Embedding`'s forward over a BlockMatrix [vocab, hidden] (no parameters: nothing for the loader
    to materialise or the optimizer-free model to move)."""

    def __init__(self, table: BlockMatrix):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.rows, table.cols

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.table, input_ids.to(torch.int64))
