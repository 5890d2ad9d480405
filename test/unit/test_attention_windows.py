"""`torch_native` runs sliding-window and soft-capped attention layers (Mistral's and Gemma 2/3's
`sliding_window`, Gemma 2's `attn_logit_softcapping`) in decode, extend (with and without a cached prefix),
chunked extend and mixed steps, on its PyTorch path and on the int8 model's CPU kernels (fp32 and fp16
pools): the token at position p sees the keys at p - W < j <= p, its scaled scores s become
cap * tanh(s / cap), and each result equals a float64 reference. Pool slots before a token's window hold
NaN, so a key read (or weighted) outside the window would show."""

from __future__ import annotations

import pytest
import torch

from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.attention.base import AttentionLayer
from srt.model_executor.attention.torch_native import TorchNativeAttnBackend
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.model_executor.layers import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
SCALE = HEAD_DIM**-0.5
Q_SCALE = 3.0  # scores of a few units, so a cap of CAP changes them
CAP = 4.0
SPARE_SLOTS = 8
ATOL, RTOL = 3e-5, 1e-4  # fp32 against float64


@pytest.fixture(params=["torch", "kernels", "kernels-fp16"])
def path(request) -> tuple[object, torch.dtype]:
    """(the backend's `cpu_kernels`, the KV pool's dtype): the PyTorch path, or the CPU kernels."""
    if request.param == "torch":
        return None, torch.float32
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("srt's CPU kernels do not load here")
    return kernels, torch.float16 if request.param == "kernels-fp16" else torch.float32


class Seqs:
    """Sequences of the given lengths with random q, k, v at every position, at shuffled slots of one
    pool; a step takes any span (prefix, new) of each, so chunked and whole runs see the same tokens."""

    def __init__(self, lens: list[int], path, seed: int):
        self.kernels, self.kv_dtype = path
        gen = torch.Generator().manual_seed(seed)
        total = sum(lens)
        self.kv_pool = MHATokenToKVPool(total + SPARE_SLOTS, self.kv_dtype, KV_HEADS, HEAD_DIM, 1, "cpu")
        self.req_pool = ReqToTokenPool(len(lens) + 2, max(lens) + 4, "cpu")
        order = torch.randperm(total + SPARE_SLOTS, generator=gen)[:total] + 1
        self.slots = list(order.split(lens))
        self.rows = torch.randperm(self.req_pool.size, generator=gen)[: len(lens)]
        for row, slots in zip(self.rows.tolist(), self.slots, strict=True):
            self.req_pool.req_to_token[row, : len(slots)] = slots

        def draw(n: int, heads: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(n, heads, HEAD_DIM, generator=gen) * scale

        self.q = [draw(n, HEADS, Q_SCALE) for n in lens]
        # K/V as the pool holds them (the reference and the step's own k, v alike)
        self.k = [draw(n, KV_HEADS).to(self.kv_dtype).float() for n in lens]
        self.v = [draw(n, KV_HEADS).to(self.kv_dtype).float() for n in lens]

    def run(self, spans: list[tuple[int, int, int]], layer: AttentionLayer, mode: ForwardMode,
            num_decode: int = 0) -> torch.Tensor:  # fmt: skip
        """One step over spans (sequence, prefix, new): the prefixes' K/V go into the pool first, with
        NaN at every slot before the first new token's window; returns [tokens, heads * head_dim]."""
        k_buf, v_buf = self.kv_pool.get_kv_buffer(0)
        for i, prefix, _ in spans:
            hidden = max(0, prefix + 1 - layer.sliding_window) if layer.sliding_window else 0
            k_buf[self.slots[i][:prefix]] = self.k[i][:prefix].to(self.kv_dtype)
            v_buf[self.slots[i][:prefix]] = self.v[i][:prefix].to(self.kv_dtype)
            k_buf[self.slots[i][:hidden]] = float("nan")
            v_buf[self.slots[i][:hidden]] = float("nan")
        news = [n for _, _, n in spans]
        totals = [p + n for _, p, n in spans]
        extend = mode is not ForwardMode.DECODE
        batch = ForwardBatch(
            mode=mode,
            batch_size=len(spans),
            input_ids=torch.zeros(sum(news), dtype=torch.int64),
            positions=torch.cat([torch.arange(p, p + n) for _, p, n in spans]),
            out_cache_loc=torch.cat([self.slots[i][p : p + n] for i, p, n in spans]),
            req_pool_indices=self.rows[[i for i, _, _ in spans]],
            seq_lens=torch.tensor(totals),
            seq_lens_cpu=totals,
            extend_prefix_lens_cpu=[p for _, p, _ in spans] if extend else None,
            extend_seq_lens_cpu=news if extend else None,
            num_decode=num_decode,
        )
        backend = TorchNativeAttnBackend(self.req_pool, self.kv_pool, HEADS, KV_HEADS, HEAD_DIM, "cpu")
        backend.cpu_kernels = self.kernels
        assert backend.unsupported(layer) is None
        backend.init_forward_metadata(batch)
        q, k, v = (torch.cat([t[i][p : p + n] for i, p, n in spans]) for t in (self.q, self.k, self.v))
        return backend.forward(q, k, v, layer, batch)

    def reference(self, spans, window: int | None, cap: float | None) -> torch.Tensor:
        """float64 attention of each new token over the keys p - W < j <= p of its sequence."""
        outs = []
        for i, prefix, n in spans:
            keys = self.k[i][: prefix + n].double().repeat_interleave(HEADS // KV_HEADS, 1)
            values = self.v[i][: prefix + n].double().repeat_interleave(HEADS // KV_HEADS, 1)
            scores = torch.einsum("qhd,khd->hqk", self.q[i][prefix : prefix + n].double(), keys) * SCALE
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            position = torch.arange(prefix, prefix + n)[:, None]
            key = torch.arange(prefix + n)[None, :]
            visible = key <= position
            if window is not None:
                visible &= key > position - window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, values).reshape(n, -1))
        return torch.cat(outs)


def check(seqs: Seqs, spans, mode: ForwardMode, window: int | None, cap: float | None, num_decode: int = 0):
    got = seqs.run(spans, AttentionLayer(0, SCALE, window, cap), mode, num_decode)
    expected = seqs.reference(spans, window, cap)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=RTOL)
    return got


@pytest.mark.parametrize("cap", [None, CAP])
def test_decode_sees_only_the_last_window_of_keys(path, cap):
    """Sequences shorter than, equal to and longer than the window in one decode step."""
    lens = [5, 12, 40, 27, 64]
    seqs = Seqs(lens, path, seed=1)
    spans = [(i, n - 1, 1) for i, n in enumerate(lens)]
    check(seqs, spans, ForwardMode.DECODE, 12, cap)


@pytest.mark.parametrize("cap", [None, CAP])
def test_extend_after_a_prefix_longer_than_the_window(path, cap):
    """A cached prefix past the window, a prompt longer than the window, one shorter, one within it."""
    seqs = Seqs([70, 45, 20, 9], path, seed=2)
    spans = [(0, 50, 20), (1, 5, 40), (2, 0, 20), (3, 3, 6)]
    check(seqs, spans, ForwardMode.EXTEND, 16, cap)


@pytest.mark.parametrize("cap", [None, CAP])
def test_a_chunked_extend_equals_the_whole_extend(path, cap):
    """The same prompt prefilled at once and in three chunks (positions are absolute, so each chunk's
    tokens see the previous chunk's keys in their windows); on the kernels to the bit, and decoding its
    last token gives that token's bits there too."""
    n, window = 58, 13
    seqs = Seqs([n], path, seed=3)
    whole = check(seqs, [(0, 0, n)], ForwardMode.EXTEND, window, cap)
    chunks = [
        check(seqs, [(0, a, b - a)], ForwardMode.EXTEND, window, cap) for a, b in ((0, 21), (21, 40), (40, n))
    ]
    decoded = check(seqs, [(0, n - 1, 1)], ForwardMode.DECODE, window, cap)
    kernels, _ = path
    if kernels is not None:
        assert torch.equal(torch.cat(chunks), whole)
        assert torch.equal(decoded, whole[-1:])
    else:
        torch.testing.assert_close(torch.cat(chunks), whole, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("window", "cap"), [(10, None), (None, CAP), (10, CAP)])
def test_a_mixed_step(path, window, cap):
    """Two prefills (one after a prefix) and a decoding tail of three, in one step."""
    seqs = Seqs([30, 18, 25, 6, 41], path, seed=4)
    spans = [(0, 12, 18), (1, 0, 18), (2, 24, 1), (3, 5, 1), (4, 40, 1)]
    check(seqs, spans, ForwardMode.MIXED, window, cap, num_decode=3)


def test_a_cap_changes_the_result():
    """The cap tests above test something: at these score sizes a capped layer differs from its uncapped
    form by far more than the tolerance."""
    seqs = Seqs([20], (None, torch.float32), seed=5)
    capped, uncapped = seqs.reference([(0, 0, 20)], None, CAP), seqs.reference([(0, 0, 20)], None, None)
    assert (capped - uncapped).abs().max() > 100 * ATOL


@pytest.mark.parametrize("cap", [None, CAP])
def test_a_window_no_sequence_outgrows_is_full_attention(path, cap):
    """With W at least every sequence's length, a windowed layer gives full attention's bits, in decode and
    in extend (with and without a prefix)."""
    lens = [9, 23, 16]
    seqs = Seqs(lens, path, seed=6)
    for mode, spans in (
        (ForwardMode.DECODE, [(i, n - 1, 1) for i, n in enumerate(lens)]),
        (ForwardMode.EXTEND, [(0, 0, 9), (1, 7, 16), (2, 15, 1)]),
    ):
        full = check(seqs, spans, mode, None, cap)
        for window in (max(lens), 1000):
            assert torch.equal(seqs.run(spans, AttentionLayer(0, SCALE, window, cap), mode), full)


def test_torch_native_accepts_windows_and_caps_but_not_empty_ones():
    seqs = Seqs([4], (None, torch.float32), seed=7)
    backend = TorchNativeAttnBackend(seqs.req_pool, seqs.kv_pool, HEADS, KV_HEADS, HEAD_DIM, "cpu")
    assert backend.unsupported(AttentionLayer(0, SCALE, 4096, 50.0)) is None
    assert "window" in backend.unsupported(AttentionLayer(0, SCALE, 0))
    assert "cap" in backend.unsupported(AttentionLayer(0, SCALE, None, 0.0))
