"""`triton`: paged attention in Triton kernels that read K/V in place from the pool; the CUDA default when
flashinfer is not installed.

Why: the `torch_native` backend gathers every sequence's K/V into a padded copy per layer, which costs a
full extra read and write of the KV a step touches; these kernels follow `req_to_token` from inside the
kernel instead. The decode path needs no host data (no `seq_lens_cpu`, no `.item()`, shapes and grids from
the batch size alone), so a CUDA graph captured once replays correctly as sequences grow. Extend and mixed
steps build three small index tensors per step from the batch's host lists, once, not per layer.

Sliding-window and soft-capped layers (Mistral, Gemma 2) run too: the window and cap go to the kernels as
the layer's constants, so a decode step stays graph-safe, and a window is skipped over, not masked, so a
long sequence's windowed layer reads only its last W positions.

Runs on the CPU only under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is imported),
which is how the unit tests check it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from srt.model_executor.attention.base import AttentionBackend, AttentionLayer
from srt.model_executor.attention.triton_launch import block_d, decode_attention, extend_attention
from srt.model_executor.attention.window_cap import window_and_cap_unsupported
from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class _ExtendMeta:
    q_starts: torch.Tensor  # int32 [num_seqs] first row of each sequence in the step's token arrays
    new_lens: torch.Tensor  # int32 [num_seqs] new tokens of each sequence this step
    prefix_lens: torch.Tensor  # int32 [num_seqs] tokens already in the pool before this step
    max_new_tokens: int  # sizes the launch grid


class TritonAttnBackend(AttentionBackend):
    """The decode path reads only device tensors (`seq_lens`, `req_pool_indices`, `req_to_token`, the pool)
    and allocates its scratch inside `forward`, so the CUDA-graph runner may capture `forward` for a batch
    size and replay it with new contents in those tensors. A mixed batch's decoding tail runs through the
    extend kernel as sequences of one new token."""

    cuda_graph_safe_decode = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        block_d(self.head_dim)  # refuses an unsupported head_dim now rather than at the first step
        self._extend: _ExtendMeta | None = None

    def unsupported(self, layer: AttentionLayer) -> str | None:
        """The kernels take any score scale, a sliding window of at least one position and a positive cap."""
        return window_and_cap_unsupported(layer.sliding_window, layer.logit_cap)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            return  # decode reads the batch's device tensors directly in forward
        counts = batch.new_token_counts()
        prefix_lens = batch.extend_prefix_lens_cpu or [0] * batch.batch_size
        starts = list(itertools.accumulate(counts, initial=0))[:-1]
        table = torch.tensor([starts, counts, prefix_lens], dtype=torch.int32, device=self.device)
        self._extend = _ExtendMeta(table[0], table[1], table[2], max(counts))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        self.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if q.stride(-1) != 1:
            q = q.contiguous()
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        req_to_token = self.req_to_token_pool.req_to_token
        window_and_cap = dict(sliding_window=layer.sliding_window, logit_cap=layer.logit_cap)
        if batch.is_decode:
            decode_attention(
                q, k_buf, v_buf, out, req_to_token, batch.req_pool_indices, batch.seq_lens, layer.scaling,
                **window_and_cap,
            )  # fmt: skip
        else:
            meta = self._extend
            extend_attention(
                q, k_buf, v_buf, k, v, out, req_to_token, batch.req_pool_indices, meta.q_starts, meta.new_lens,
                meta.prefix_lens, meta.max_new_tokens, layer.scaling, **window_and_cap,
            )  # fmt: skip
        return out.view(num_tokens, self.num_heads * self.head_dim)
