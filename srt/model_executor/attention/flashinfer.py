"""`flashinfer`: paged prefill/decode kernels on CUDA. Minimal by design (page size 1, one plan per step).

Importing this module never imports flashinfer: the package is loaded when a backend is constructed, so
the module stays importable on a CPU-only machine. The registry only offers this backend when CUDA is
available and flashinfer is installed.
"""

from __future__ import annotations

import torch

from srt.model_executor.attention.base import AttentionBackend, AttentionLayer
from srt.model_executor.forward_batch_info import ForwardBatch

PAGE_SIZE = 1  # one token per page: the pool's slots are pages
WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's scratch buffer; its documented default size
KV_LAYOUT = "NHD"  # pool buffers are [slots, kv_heads, head_dim]
# head sizes flashinfer's prefill and decode kernels are built for; it refuses others at run time (head_dim
# 16: "Invalid configuration", seen on an H200)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


class FlashInferAttnBackend(AttentionBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import flashinfer  # deferred: see module docstring

        # a step's plan fixes the score scale for every layer: 1/sqrt(head_dim), the one it runs
        self.plan_scaling = self.head_dim**-0.5
        dtype = self.token_to_kv_pool_dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"attention backend 'flashinfer' has no {dtype} kernels: use --dtype bfloat16 or float16"
            )
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"attention backend 'flashinfer' has no kernels for head_dim {self.head_dim} "
                f"(it has {', '.join(map(str, SUPPORTED_HEAD_DIMS))}): use --attention-backend triton"
            )
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, KV_LAYOUT)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, KV_LAYOUT)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        seq_lens = batch.seq_lens.to(torch.int32)
        kv_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32, device=self.device)
        kv_indptr[1:] = torch.cumsum(seq_lens, 0)
        table = self.req_to_token_pool.req_to_token[batch.req_pool_indices]
        valid = torch.arange(table.shape[1], device=self.device)[None, :] < batch.seq_lens[:, None]
        kv_indices = table[valid].to(torch.int32)  # row-major: each sequence's slots in order
        last_page_len = torch.ones(batch.batch_size, dtype=torch.int32, device=self.device)
        common = dict(q_data_type=self.token_to_kv_pool_dtype, kv_data_type=self.token_to_kv_pool_dtype)
        if batch.is_decode:
            self._decode.plan(
                kv_indptr, kv_indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
                PAGE_SIZE, sm_scale=self.plan_scaling, **common,
            )  # fmt: skip
            return
        qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32, device=self.device)
        new_counts = torch.tensor(batch.new_token_counts(), dtype=torch.int32, device=self.device)
        qo_indptr[1:] = torch.cumsum(new_counts, 0)
        self._prefill.plan(
            qo_indptr, kv_indptr, kv_indices, last_page_len, self.num_heads, self.num_kv_heads, self.head_dim,
            PAGE_SIZE, causal=True, sm_scale=self.plan_scaling, **common,
        )  # fmt: skip

    @property
    def token_to_kv_pool_dtype(self) -> torch.dtype:
        return self.token_to_kv_pool.get_kv_buffer(0)[0].dtype

    def unsupported(self, layer: AttentionLayer) -> str | None:
        if layer.scaling != self.plan_scaling:
            return f"a score scale other than 1/sqrt(head_dim) ({layer.scaling})"
        return super().unsupported(layer)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        self.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        paged = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))  # [pages, page_size=1, kv_heads, head_dim]
        wrapper = self._decode if batch.is_decode else self._prefill
        out = wrapper.run(q.contiguous(), paged)
        return out.view(q.shape[0], self.num_heads * self.head_dim)
