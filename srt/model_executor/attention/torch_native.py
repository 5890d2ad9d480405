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

Sliding windows and soft-caps (`AttentionLayer.sliding_window`, `.logit_cap`): with a window of W keys a
token at position p sees the keys at positions p - W < j <= p. Where a sequence is no longer than W the
window changes nothing and the full-attention path runs. Otherwise extend masks each sequence's keys from
the first one any of its new tokens sees (the rest are not gathered), and decode gathers only each
sequence's last W slots (one table per window and step, shared by the layers of that window). A capped
layer's scores cap * tanh(score / cap) cannot go through SDPA: capped layers alone compute their scores
explicitly (`_capped_attention`). The CPU kernels take both as arguments and read only the window's keys.
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
# A soft-capped extend computes its scores explicitly: at most this many at once (64 MB in fp32).
CAPPED_SCORES_PER_CHUNK = 1 << 24


@dataclass
class _ExtendSeq:
    start: int  # first row of this sequence in the step's token arrays
    num_new: int
    prefix_len: int
    kv_indices: torch.Tensor | None  # all slots (prefix + new): with a prefix, or for the CPU kernel
    mask: torch.Tensor | None  # bool [num_new, prefix_len + num_new], True = may attend


@dataclass
class _WindowedSeq:
    """An extend sequence's keys under a sliding window that hides some of them (PyTorch path)."""

    key_start: int  # the first key any of its new tokens sees
    mask: torch.Tensor  # bool [num_new, prefix_len + num_new - key_start], True = may attend


@dataclass
class _DecodeMeta:
    # int64 [bs * max_len], padding positions -> PADDING_SLOT; for the CPU kernel, [bs, max_len] unpadded
    kv_indices: torch.Tensor
    max_len: int
    mask: torch.Tensor | None  # bool [bs, 1, 1, max_len]; None when every sequence has max_len tokens
    seq_lens: torch.Tensor | None = None  # int64 [bs], for the CPU kernel only
    # where the slots came from: windowed tables are built from these (PyTorch path)
    req_pool_indices: torch.Tensor | None = None
    lens: torch.Tensor | None = None  # int64 [bs]
    min_len: int = 0


class TorchNativeAttnBackend(AttentionBackend):
    """Decode gathers into two persistent workspaces instead of fresh tensors: a fresh multi-MB tensor per
    layer is a fresh mmap whose page faults cost more than the copy itself (measured: 4 ms vs 1.4 ms per
    gather of 64 x 300 tokens)."""

    _k_workspace: torch.Tensor | None = None
    _v_workspace: torch.Tensor | None = None
    # With the int8 model's fused CPU kernels (`cpu_kernels`, given at construction), decode attends straight
    # out of the pool in one call per layer, with no gathered copy of the K/V.

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

    def unsupported(self, layer: AttentionLayer) -> str | None:
        """Sliding windows and soft-caps run here (PyTorch and CPU-kernel paths alike)."""
        if layer.sliding_window is not None and layer.sliding_window < 1:
            return f"a sliding window of {layer.sliding_window} keys"
        if layer.logit_cap is not None and not layer.logit_cap > 0:
            return f"a logit soft-cap of {layer.logit_cap}"
        return None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # this step's windowed index tables and masks, by window, built by the first layer that needs one
        self._decode_windows: dict[int, _DecodeMeta] = {}
        self._extend_windows: dict[int, list[_WindowedSeq | None]] = {}
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

    def token_slots(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each fed token's (slots int64 [tokens, max_len], seq_lens int64 [tokens]) as the CPU decode
        attention kernel reads them (with `cpu_kernels` only). A token at position p of a sequence attends to
        that sequence's first p + 1 slots, all in `req_to_token` before the step runs (ForwardBatch's
        invariant); so an extend step of a few tokens (a speculative verify step: newest token + drafts) is
        as many decode rows sharing their sequence's table row, and attends causally with the same kernel
        and order of operations as decode. Decode: the table `init_forward_metadata` built."""
        if batch.is_decode:
            return self._decode.kv_indices, self._decode.seq_lens
        counts = batch.new_token_counts()
        if len(counts) == 1:
            rows = batch.req_pool_indices.expand(batch.num_tokens)
        else:
            rows = batch.req_pool_indices.repeat_interleave(
                torch.tensor(counts, device=batch.req_pool_indices.device)
            )
        max_len = max(batch.seq_lens_cpu)
        return self.req_to_token_pool.req_to_token[rows, :max_len], batch.positions + 1

    def _decode_metadata(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int]
    ) -> _DecodeMeta:
        max_len = max(seq_lens_cpu)
        rows = self.req_to_token_pool.req_to_token[req_pool_indices, :max_len]
        if self.cpu_kernels is not None:  # the kernel reads each row's first seq_lens[b] slots: no padding
            return _DecodeMeta(rows, max_len, None, seq_lens.to(torch.int64).contiguous())
        if min(seq_lens_cpu) == max_len:
            return _DecodeMeta(rows.reshape(-1), max_len, None, None, req_pool_indices, seq_lens, max_len)
        valid = torch.arange(max_len, device=rows.device)[None, :] < seq_lens[:, None]
        kv_indices = rows.masked_fill(~valid, PADDING_SLOT).reshape(-1)
        mask = valid[:, None, None, :]
        return _DecodeMeta(kv_indices, max_len, mask, None, req_pool_indices, seq_lens, min(seq_lens_cpu))

    def _decode_meta(self, window: int | None) -> _DecodeMeta:
        """The decode table for a layer with this window (PyTorch path): the step's own where no sequence is
        longer than the window, else each sequence's last `window` slots, padded and masked."""
        meta = self._decode
        if window is None or meta.max_len <= window:
            return meta
        if window not in self._decode_windows:
            lens = meta.lens.to(torch.int64)
            offsets = torch.arange(window, device=lens.device)
            first = (lens - window).clamp(min=0)
            valid = offsets[None, :] < lens.clamp(max=window)[:, None]
            positions = (first[:, None] + offsets[None, :]).clamp(max=meta.max_len - 1)
            table = self.req_to_token_pool.req_to_token
            slots = (
                table[meta.req_pool_indices[:, None], positions].masked_fill(~valid, PADDING_SLOT).reshape(-1)
            )
            mask = None if meta.min_len >= window else valid[:, None, None, :]
            self._decode_windows[window] = _DecodeMeta(slots, window, mask)
        return self._decode_windows[window]

    def _extend_window(self, window: int | None) -> list[_WindowedSeq | None]:
        """Per extend sequence, its windowed keys and mask, or None where the window hides no key of it (no
        token past position window - 1): such a sequence runs as full attention (PyTorch path)."""
        if window is None:
            return [None] * len(self._extend)
        if window not in self._extend_windows:
            seqs = []
            for seq in self._extend:
                total = seq.prefix_len + seq.num_new
                if total <= window:
                    seqs.append(None)
                    continue
                key_start = max(0, seq.prefix_len + 1 - window)
                device = self.req_to_token_pool.req_to_token.device
                keys = torch.arange(key_start, total, device=device)[None, :]
                positions = torch.arange(seq.prefix_len, total, device=device)[:, None]
                seqs.append(_WindowedSeq(key_start, (keys <= positions) & (keys > positions - window)))
            self._extend_windows[window] = seqs
        return self._extend_windows[window]

    def _extend_metadata(self, batch: ForwardBatch, num_seqs: int) -> list[_ExtendSeq]:
        """The first `num_seqs` sequences of the batch (a mixed batch's decoding tail is not extended)."""
        prefix_lens = batch.extend_prefix_lens_cpu or [0] * batch.batch_size
        seqs, start = [], 0
        for i, num_new in enumerate(batch.new_token_counts()[:num_seqs]):
            prefix = prefix_lens[i]
            kv_indices = mask = None
            total = prefix + num_new
            if prefix > 0 or self.cpu_kernels is not None:
                # a one-row index tensor, not a scalar: indexing by a 0-dim device tensor reads it back
                # to the host (a synchronization per sequence on a GPU)
                row = batch.req_pool_indices[i : i + 1]
                kv_indices = self.req_to_token_pool.req_to_token[row, :total].squeeze(0)
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
        k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if self.cpu_kernels is not None:
            meta = self._decode
            queries = q.view(bs, self.num_heads, self.head_dim)
            return self.cpu_kernels.decode_attention(
                queries, k_buf, v_buf, meta.kv_indices, meta.seq_lens, layer.scaling,
                layer.sliding_window, layer.logit_cap,
            )  # fmt: skip
        meta = self._decode_meta(layer.sliding_window)
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
        if layer.logit_cap is not None:
            out = _capped_attention(queries, keys, values, meta.mask, layer.scaling, layer.logit_cap)
        else:
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=meta.mask, scale=layer.scaling
            )
        return out.reshape(bs, self.num_heads * self.head_dim)

    def _forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, out: torch.Tensor
    ) -> None:
        """Attention of the extend sequences' tokens, written into `out` [tokens, heads, head_dim]."""
        k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        windows = self._extend_window(layer.sliding_window) if self.cpu_kernels is None else None
        for i, seq in enumerate(self._extend):
            rows = slice(seq.start, seq.start + seq.num_new)
            if self.cpu_kernels is not None:
                self.cpu_kernels.extend_attention(
                    q[rows], k_buf, v_buf, seq.kv_indices, seq.prefix_len, layer.scaling, out[rows],
                    layer.sliding_window, layer.logit_cap,
                )  # fmt: skip
                continue
            window = windows[i]
            mask = seq.mask if window is None else window.mask
            if seq.kv_indices is None:  # no prefix: this step's own K/V (a window starts at key 0 here)
                keys, values = k[rows], v[rows]
            else:
                slots = seq.kv_indices if window is None else seq.kv_indices[window.key_start :]
                keys = k_buf.index_select(0, slots).to(q.dtype)
                values = v_buf.index_select(0, slots).to(q.dtype)
            if layer.logit_cap is not None:
                out[rows] = _capped_extend(q[rows], keys, values, mask, layer.scaling, layer.logit_cap)
                continue
            # SDPA wants [heads, tokens, head_dim]
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=layer.scaling,
                enable_gqa=True,
            )[0].transpose(0, 1)


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float
) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA cannot do: softmax(cap * tanh(q k^T * scale / cap))
    v, the softmax in fp32 (as Hugging Face's eager Gemma 2). q [..., rows, d]; k, v [..., keys, d]
    (broadcasting over the leading dimensions); mask bool broadcastable to [..., rows, keys], True = may
    attend, or None for every key."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


def _capped_extend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, cap: float
) -> torch.Tensor:
    """One extend sequence's soft-capped attention: q [n, heads, d], k, v [keys, kv_heads, d] (its last n
    keys are the new tokens'), mask bool [n, keys] or None for causal. Returns [n, heads, d]; the queries
    go in chunks so the explicit scores stay under CAPPED_SCORES_PER_CHUNK."""
    n, heads, head_dim = q.shape
    num_keys, kv_heads = k.shape[0], k.shape[1]
    if mask is None:  # causal: new token i sees every key up to its own (bottom-right aligned)
        mask = torch.ones(n, num_keys, dtype=torch.bool, device=q.device).tril(num_keys - n)
    group = heads // kv_heads
    keys, values = k.transpose(0, 1).unsqueeze(1), v.transpose(0, 1).unsqueeze(1)  # [kv_heads, 1, keys, d]
    out = torch.empty_like(q)
    chunk = max(1, CAPPED_SCORES_PER_CHUNK // (heads * num_keys))
    for r in range(0, n, chunk):
        rows = slice(r, min(n, r + chunk))
        # [kv_heads, group, rows, d]: query head h = g * group + j uses KV head g
        queries = q[rows].reshape(-1, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        attended = _capped_attention(queries, keys, values, mask[rows], scale, cap)
        out[rows] = attended.permute(2, 0, 1, 3).reshape(-1, heads, head_dim)
    return out
