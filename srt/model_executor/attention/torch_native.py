"""`torch_native`: scaled_dot_product_attention over K/V gathered from the paged pool. Runs everywhere;
the CPU default.

Extend runs one SDPA call per sequence (a loop over sequences, never over tokens): with no cached prefix
it attends over this step's own K/V (no gather); with a prefix it gathers the sequence's slots from the
pool and applies a causal mask shifted by the prefix length. Decode gathers every sequence's slots into one
padded `[bs, max_len]` index table once per step and runs a single SDPA call per layer, with the query
heads of each KV group laid out as that group's "query rows" so no K/V repetition is needed for GQA.
A mixed batch runs its prefill sequences through the extend path and its decoding tail (`num_decode`
sequences of one token each) through the decode path, so the running requests' attention costs what it
costs in a decode step.

With the int8 model's CPU kernels, extend and decode both attend straight out of the pool through kernels
that share one order of operations per token (`cpu_attention_kernels.c`, attend_rows): a token's attention
does not depend on how its prompt was split into chunks, on a prefix-cache hit, on retraction and
re-prefill, or on what else is in the step. Together with the row-invariant int8 linear layers this makes
the int8 CPU model batch-invariant: a greedy request's output is the same however it was scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srt.mem_cache.memory_pool import PADDING_SLOT  # padded index positions point at the reserved slot
from srt.model_executor.attention.base import AttentionBackend, AttentionLayer
from srt.model_executor.forward_batch_info import ForwardBatch

# The decode gather buffers grow by at least this factor, so a slowly growing batch reallocates rarely.
WORKSPACE_GROWTH = 1.5


@dataclass
class _ExtendSeq:
    start: int  # first row of this sequence in the step's token arrays
    num_new: int
    prefix_len: int
    kv_indices: torch.Tensor | None  # all slots (prefix + new): with a prefix, or for the CPU kernel
    mask: torch.Tensor | None  # bool [num_new, prefix_len + num_new], True = may attend


@dataclass
class _DecodeMeta:
    # int64 [bs * max_len], padding positions -> PADDING_SLOT; for the CPU kernel, [bs, max_len] unpadded
    kv_indices: torch.Tensor
    max_len: int
    mask: torch.Tensor | None  # bool [bs, 1, 1, max_len]; None when every sequence has max_len tokens
    seq_lens: torch.Tensor | None = None  # int64 [bs], for the CPU kernel only


class TorchNativeAttnBackend(AttentionBackend):
    """Decode gathers into two persistent workspaces instead of fresh tensors: a fresh multi-MB tensor per
    layer is a fresh mmap whose page faults cost more than the copy itself (measured: 4 ms vs 1.4 ms per
    gather of 64 x 300 tokens)."""

    _k_workspace: torch.Tensor | None = None
    _v_workspace: torch.Tensor | None = None
    # Set with the int8 model's fused CPU kernels (quantization.py): decode then attends straight out of the
    # pool in one call per layer, with no gathered copy of the K/V.
    cpu_kernels = None

    def _workspaces(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._k_workspace is None or self._k_workspace.shape[0] < rows:
            k_buf, _ = self.token_to_kv_pool.get_kv_buffer(0)
            size = max(
                rows, int(0 if self._k_workspace is None else self._k_workspace.shape[0] * WORKSPACE_GROWTH)
            )
            shape = (size, self.num_kv_heads, self.head_dim)
            self._k_workspace = torch.empty(shape, dtype=k_buf.dtype, device=k_buf.device)
            self._v_workspace = torch.empty(shape, dtype=k_buf.dtype, device=k_buf.device)
        return self._k_workspace[:rows], self._v_workspace[:rows]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            self._decode = self._decode_metadata(batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu)
            return
        num_extend = batch.batch_size - batch.num_decode
        self._extend = self._extend_metadata(batch, num_extend)
        if batch.is_mixed:
            self._decode = self._decode_metadata(
                batch.req_pool_indices[num_extend:],
                batch.seq_lens[num_extend:],
                batch.seq_lens_cpu[num_extend:],
            )
            self._num_extend_tokens = batch.num_tokens - batch.num_decode

    def decode_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This decode step's (slots int64 [bs, max_len], seq_lens int64 [bs]) as the CPU attention kernel
        reads them (set by `init_forward_metadata`; with `cpu_kernels` only)."""
        meta = self._decode
        return meta.kv_indices, meta.seq_lens

    def _decode_metadata(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int]
    ) -> _DecodeMeta:
        max_len = max(seq_lens_cpu)
        rows = self.req_to_token_pool.req_to_token[req_pool_indices, :max_len]
        if self.cpu_kernels is not None:  # the kernel reads each row's first seq_lens[b] slots: no padding
            return _DecodeMeta(rows, max_len, None, seq_lens.to(torch.int64).contiguous())
        if min(seq_lens_cpu) == max_len:
            return _DecodeMeta(rows.reshape(-1), max_len, None)
        valid = torch.arange(max_len, device=rows.device)[None, :] < seq_lens[:, None]
        kv_indices = rows.masked_fill(~valid, PADDING_SLOT).reshape(-1)
        return _DecodeMeta(kv_indices, max_len, valid[:, None, None, :])

    def _extend_metadata(self, batch: ForwardBatch, num_seqs: int) -> list[_ExtendSeq]:
        """The first `num_seqs` sequences of the batch (a mixed batch's decoding tail is not extended)."""
        prefix_lens = batch.extend_prefix_lens_cpu or [0] * batch.batch_size
        seqs, start = [], 0
        for i, num_new in enumerate(batch.new_token_counts()[:num_seqs]):
            prefix = prefix_lens[i]
            kv_indices = mask = None
            total = prefix + num_new
            if prefix > 0 or self.cpu_kernels is not None:
                kv_indices = self.req_to_token_pool.req_to_token[batch.req_pool_indices[i], :total]
            if prefix > 0 and self.cpu_kernels is None:
                # bottom-right aligned causal mask: new token j sees every slot up to prefix + j
                mask = torch.ones(num_new, total, dtype=torch.bool, device=kv_indices.device).tril(prefix)
            seqs.append(_ExtendSeq(start, num_new, prefix, kv_indices, mask))
            start += num_new
        return seqs

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        self.token_to_kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.is_decode:
            return self._forward_decode(q, layer, batch.batch_size)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if not batch.is_mixed:
            self._forward_extend(q, k, v, layer, out)
            return out.view(q.shape[0], self.num_heads * self.head_dim)
        split = self._num_extend_tokens
        self._forward_extend(q[:split], k[:split], v[:split], layer, out[:split])
        decoded = self._forward_decode(q[split:], layer, batch.num_decode)
        out[split:] = decoded.view(batch.num_decode, self.num_heads, self.head_dim)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _forward_decode(self, q: torch.Tensor, layer: AttentionLayer, bs: int) -> torch.Tensor:
        meta = self._decode
        k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if self.cpu_kernels is not None:
            queries = q.view(bs, self.num_heads, self.head_dim)
            return self.cpu_kernels.decode_attention(
                queries, k_buf, v_buf, meta.kv_indices, meta.seq_lens, layer.scaling
            )
        shape = (bs, meta.max_len, self.num_kv_heads, self.head_dim)
        k_ws, v_ws = self._workspaces(meta.kv_indices.shape[0])
        # an fp16 pool (`--kv-cache-dtype float16`) is widened for SDPA, which takes one dtype
        keys = torch.index_select(k_buf, 0, meta.kv_indices, out=k_ws).view(shape).transpose(1, 2).to(q.dtype)
        values = (
            torch.index_select(v_buf, 0, meta.kv_indices, out=v_ws).view(shape).transpose(1, 2).to(q.dtype)
        )
        group = self.num_heads // self.num_kv_heads
        # [bs, kv_heads, group, head_dim]: the group's query heads act as query rows of one KV head
        queries = q.view(bs, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=layer.scaling)
        return out.reshape(bs, self.num_heads * self.head_dim)

    def _forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, out: torch.Tensor
    ) -> None:
        """Attention of the extend sequences' tokens, written into `out` [tokens, heads, head_dim]."""
        k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        for seq in self._extend:
            rows = slice(seq.start, seq.start + seq.num_new)
            if self.cpu_kernels is not None:
                self.cpu_kernels.extend_attention(
                    q[rows], k_buf, v_buf, seq.kv_indices, seq.prefix_len, layer.scaling, out[rows]
                )
                continue
            if seq.kv_indices is None:
                keys, values = k[rows], v[rows]
            else:
                keys = k_buf.index_select(0, seq.kv_indices).to(q.dtype)
                values = v_buf.index_select(0, seq.kv_indices).to(q.dtype)
            # SDPA wants [heads, tokens, head_dim]
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=layer.scaling,
                enable_gqa=True,
            )[0].transpose(0, 1)
