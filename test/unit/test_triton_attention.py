"""The triton attention backend equals plain softmax attention over each sequence's paged K/V: decode
(split-KV, graph-safe: it reads no host data), extend with and without a cached prefix, mixed steps, reduced
precision pools, sliding windows and logit soft-caps (decode, extend, chunked prefill, mixed; keys before
every window are never read), and the whole tiny model against `torch_native`. On a CPU the kernels run under
Triton's interpreter, which must be enabled before triton is imported; `cuda`-marked tests check realistic
shapes."""

from __future__ import annotations

import itertools

import pytest
import torch

from test.unit.triton_interpreter import (
    BF16_UNSUPPORTED,
    interpreted_imports,
    interpreter_while_testing,  # noqa: F401 (autouse)
)

with interpreted_imports():
    from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from srt.model_executor.attention import registry
    from srt.model_executor.attention import triton_launch as launch
    from srt.model_executor.attention.base import AttentionLayer
    from srt.model_executor.attention.triton_backend import TritonAttnBackend
    from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_ATOL = 1e-5  # interpreter and reference differ only in summation order
REDUCED_ATOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}  # q and p rounded to the 16-bit type
SPARE_SLOTS = 16  # pool slots no sequence owns: filled with NaN, so reading one poisons the output
SPARE_ROWS = 3  # req_to_token rows no sequence uses


class Untouchable:
    """Stands in for `seq_lens_cpu`: any use fails the test (the decode path must not read host data)."""

    def _fail(self, *args):
        raise AssertionError("the decode path read seq_lens_cpu")

    __getattr__ = __iter__ = __len__ = __getitem__ = _fail


class Step:
    """A paged layout for one step: sequence i has prefix_lens[i] tokens in the pool and new_lens[i] new
    ones, at shuffled, non-contiguous slots of a shuffled request row; the rest of the pool and of each row
    points at NaN."""

    def __init__(self, prefix_lens, new_lens, heads, kv_heads, head_dim, q_dtype, kv_dtype, seed, device,
                 pool_tokens: int | None = None):  # fmt: skip
        """`pool_tokens` sizes the pools (slots and context), so layouts can be swapped into one another."""
        gen = torch.Generator().manual_seed(seed)
        totals = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
        num_slots = (pool_tokens or sum(totals)) + SPARE_SLOTS
        self.prefix_lens, self.new_lens, self.device = list(prefix_lens), list(new_lens), device
        self.kv_pool = MHATokenToKVPool(num_slots, kv_dtype, kv_heads, head_dim, 1, device)
        context_len = (pool_tokens or max(totals)) + SPARE_SLOTS
        self.req_pool = ReqToTokenPool(len(totals) + SPARE_ROWS, context_len, device)
        for buf in self.kv_pool.get_kv_buffer(0):
            buf.fill_(float("nan"))
        order = (1 + torch.randperm(num_slots, generator=gen)).to(device)
        self.slots = list(order[: sum(totals)].split(totals))
        spare = order[sum(totals) :]
        self.rows = torch.randperm(self.req_pool.size, generator=gen)[: len(totals)].to(device)
        table = self.req_pool.req_to_token
        table.copy_(spare[torch.randint(len(spare), table.shape, generator=gen).to(device)])
        for row, slots in zip(self.rows.tolist(), self.slots, strict=True):
            table[row, : len(slots)] = slots
        # the pool's cached prefix; the new tokens' K/V are written by the backend
        k_buf, v_buf = self.kv_pool.get_kv_buffer(0)
        for p, slots in zip(prefix_lens, self.slots, strict=True):
            k_buf[slots[:p]] = torch.randn(p, kv_heads, head_dim, generator=gen).to(device, kv_dtype)
            v_buf[slots[:p]] = torch.randn(p, kv_heads, head_dim, generator=gen).to(device, kv_dtype)
        n = sum(new_lens)
        self.q = torch.randn(n, heads, head_dim, generator=gen).to(device, q_dtype)
        self.k = torch.randn(n, kv_heads, head_dim, generator=gen).to(device, q_dtype)
        self.v = torch.randn(n, kv_heads, head_dim, generator=gen).to(device, q_dtype)
        self.out_cache_loc = torch.cat([s[p:] for p, s in zip(prefix_lens, self.slots, strict=True)])
        self.scaling = head_dim**-0.5

    def backend(self) -> TritonAttnBackend:
        heads, kv_heads, head_dim = self.q.shape[1], self.k.shape[1], self.q.shape[2]
        return TritonAttnBackend(self.req_pool, self.kv_pool, heads, kv_heads, head_dim, self.device)

    def batch(self, mode: ForwardMode, num_decode: int = 0, seq_lens_cpu=None) -> ForwardBatch:
        totals = [p + n for p, n in zip(self.prefix_lens, self.new_lens, strict=True)]
        extend = mode is not ForwardMode.DECODE
        return ForwardBatch(
            mode=mode,
            batch_size=len(totals),
            input_ids=torch.zeros(sum(self.new_lens), dtype=torch.int64, device=self.device),
            positions=torch.zeros(sum(self.new_lens), dtype=torch.int64, device=self.device),
            out_cache_loc=self.out_cache_loc.to(self.device),
            req_pool_indices=self.rows.to(self.device),
            seq_lens=torch.tensor(totals, dtype=torch.int64, device=self.device),
            seq_lens_cpu=totals if seq_lens_cpu is None else seq_lens_cpu,
            extend_prefix_lens_cpu=self.prefix_lens if extend else None,
            extend_seq_lens_cpu=self.new_lens if extend else None,
            num_decode=num_decode,
        )

    def layer(self, window: int | None = None, cap: float | None = None) -> AttentionLayer:
        return AttentionLayer(0, self.scaling, sliding_window=window, logit_cap=cap)

    def run(self, mode: ForwardMode, layer: AttentionLayer | None = None, **batch_kwargs) -> torch.Tensor:
        backend, batch = self.backend(), self.batch(mode, **batch_kwargs)
        layer = layer or self.layer()
        assert backend.unsupported(layer) is None
        backend.init_forward_metadata(batch)
        return backend.forward(self.q, self.k, self.v, layer, batch)

    def window_starts(self, window: int | None) -> list[int]:
        """Each sequence's first position that any of its new tokens sees: prefix - window + 1 (or 0)."""
        return [max(0, p - window + 1) if window else 0 for p in self.prefix_lens]

    def poison_before_windows(self, window: int) -> None:
        """NaN into the pool at the positions no new token of the step sees: reading one (rather than
        skipping it) poisons the output."""
        for buf in self.kv_pool.get_kv_buffer(0):
            for lo, slots in zip(self.window_starts(window), self.slots, strict=True):
                buf[slots[:lo]] = float("nan")

    def reference(self, new_from_pool: bool = False, window: int | None = None, cap: float | None = None):
        """float64 causal softmax attention over each sequence's prefix (from the pool, in its dtype) and
        new K/V: the step's own, as extend reads them, or (`new_from_pool`) rounded to the pool's dtype, as
        decode reads its one new token back from the pool. With `window` W the new token at position
        prefix + i sees positions prefix + i - W + 1 .. prefix + i; with `cap` c a scaled score s counts as
        c * tanh(s / c) (HF Mistral's and Gemma 2's semantics). Positions before every token's window are
        not read (poison_before_windows may have put NaN there)."""
        k_buf, v_buf = self.kv_pool.get_kv_buffer(0)
        group = self.q.shape[1] // self.k.shape[1]
        outs, start = [], 0
        for p, n, slots, lo in zip(self.prefix_lens, self.new_lens, self.slots, self.window_starts(window),
                                   strict=True):  # fmt: skip
            new = slice(start, start + n)
            new_k, new_v = self.k[new], self.v[new]
            if new_from_pool:
                new_k, new_v = new_k.to(k_buf.dtype), new_v.to(v_buf.dtype)
            keys = torch.cat([k_buf[slots[lo:p]].double(), new_k.double()])
            values = torch.cat([v_buf[slots[lo:p]].double(), new_v.double()])
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", self.q[new].double(), keys) * self.scaling
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            query_pos = torch.arange(p, p + n, device=scores.device)[:, None]
            key_pos = torch.arange(lo, p + n, device=scores.device)[None, :]
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, values))
            start += n
        return torch.cat(outs).reshape(sum(self.new_lens), -1)

    def part(self, seqs: list[int], prefix_lens: list[int], new_lens: list[int]) -> Step:
        """A step over this one's pools and request rows: sequence seqs[i] with prefix_lens[i] tokens cached
        and its next new_lens[i] tokens new, whose q/k/v are this step's rows for those positions (this
        step's new tokens start at its own prefix_lens)."""
        part = object.__new__(Step)
        part.kv_pool, part.req_pool, part.device, part.scaling = (
            self.kv_pool,
            self.req_pool,
            self.device,
            self.scaling,
        )
        part.rows, part.slots = self.rows[seqs], [self.slots[i] for i in seqs]
        part.prefix_lens, part.new_lens = list(prefix_lens), list(new_lens)
        starts = list(itertools.accumulate(self.new_lens, initial=0))
        tokens = torch.cat([
            torch.arange(p, p + n) - self.prefix_lens[i] + starts[i]
            for i, p, n in zip(seqs, prefix_lens, new_lens, strict=True)
        ]).to(self.q.device)  # fmt: skip
        part.q, part.k, part.v = self.q[tokens], self.k[tokens], self.v[tokens]
        part.out_cache_loc = torch.cat(
            [s[p : p + n] for p, n, s in zip(prefix_lens, new_lens, part.slots, strict=True)]
        )
        return part


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and torch.isfinite(got).all(), "NaN/inf: a poisoned slot or row was read"
    atol = REDUCED_ATOL.get(dtype, FP32_ATOL)
    torch.testing.assert_close(got.double(), want.to(got.device), atol=atol, rtol=0)


DECODE_SHAPES = [(4, 2, 16), (4, 4, 64), (6, 2, 24)]  # GQA, MHA, a group of 3 with a non-power-of-two head


@pytest.mark.parametrize("heads,kv_heads,head_dim", DECODE_SHAPES)
def test_decode_matches_reference_attention(heads, kv_heads, head_dim):
    """Lengths 1, under/over one block and the split count, several splits empty; every output element
    written (the output starts as NaN)."""
    seq_lens = [1, 2, 17, 64, 65, 131]
    step = Step([n - 1 for n in seq_lens], [1] * len(seq_lens), heads, kv_heads, head_dim,
                torch.float32, torch.float32, seed=head_dim, device=DEVICE)  # fmt: skip
    step.kv_pool.set_kv_buffer(0, step.out_cache_loc, step.k, step.v)
    out = torch.full_like(step.q, float("nan"))
    batch = step.batch(ForwardMode.DECODE)
    launch.decode_attention(step.q, *step.kv_pool.get_kv_buffer(0), out, step.req_pool.req_to_token,
                             batch.req_pool_indices, batch.seq_lens, step.scaling)  # fmt: skip
    assert_matches(out.reshape(len(seq_lens), -1), step.reference(), torch.float32)


def test_decode_reads_no_host_data_and_follows_changed_tensors():
    """A graph replay changes seq_lens / req_pool_indices / req_to_token in place between calls of the same
    batch size; the backend must follow them, and never look at seq_lens_cpu."""
    sizes = dict(pool_tokens=100, device=DEVICE)
    first = Step([4, 40, 0], [1, 1, 1], 4, 2, 16, torch.float32, torch.float32, seed=1, **sizes)
    batch = first.batch(ForwardMode.DECODE, seq_lens_cpu=Untouchable())
    backend = first.backend()
    backend.init_forward_metadata(batch)
    assert_matches(
        backend.forward(first.q, first.k, first.v, AttentionLayer(0, first.scaling), batch),
        first.reference(),
        torch.float32,
    )
    assert TritonAttnBackend.cuda_graph_safe_decode
    # same pools and batch tensors, new contents: other lengths, rows and slots
    second = Step([70, 0, 9], [1, 1, 1], 4, 2, 16, torch.float32, torch.float32, seed=2, **sizes)
    move_layout(second, into=first, batch=batch)
    backend.init_forward_metadata(batch)
    assert_matches(
        backend.forward(second.q, second.k, second.v, AttentionLayer(0, second.scaling), batch),
        second.reference(),
        torch.float32,
    )


def move_layout(src: Step, into: Step, batch: ForwardBatch) -> None:
    """Copy src's pools and batch tensors into `into`'s (same sizes) in place, as a graph replay sees them."""
    into.req_pool.req_to_token.copy_(src.req_pool.req_to_token)
    for old, new in zip(into.kv_pool.get_kv_buffer(0), src.kv_pool.get_kv_buffer(0), strict=True):
        old.copy_(new)
    fresh = src.batch(ForwardMode.DECODE)
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
        getattr(batch, name).copy_(getattr(fresh, name))


EXTEND_PREFIXES = [0, 0, 5, 33, 0]
EXTEND_NEW = [1, 70, 3, 1, 17]  # a single token, one longer than EXTEND_BLOCK_M, prefix hits


def test_extend_with_and_without_prefix_matches_reference_attention():
    assert max(EXTEND_NEW) > launch.EXTEND_BLOCK_M
    step = Step(EXTEND_PREFIXES, EXTEND_NEW, 4, 2, 16, torch.float32, torch.float32, seed=3, device=DEVICE)
    out = step.run(ForwardMode.EXTEND)
    assert out.shape == (sum(EXTEND_NEW), 4 * 16)
    assert_matches(out, step.reference(), torch.float32)


def test_extend_kernel_writes_every_row_it_owns():
    """Straight to the launcher, with a NaN-poisoned output: all rows of all sequences are written."""
    step = Step([0, 7], [5, 9], 4, 4, 16, torch.float32, torch.float32, seed=4, device=DEVICE)
    step.kv_pool.set_kv_buffer(0, step.out_cache_loc, step.k, step.v)
    out = torch.full_like(step.q, float("nan"))
    as_index = dict(dtype=torch.int32, device=DEVICE)
    starts = torch.tensor(list(itertools.accumulate(step.new_lens, initial=0))[:-1], **as_index)
    launch.extend_attention(
        step.q, *step.kv_pool.get_kv_buffer(0), step.k, step.v, out, step.req_pool.req_to_token,
        step.rows.to(DEVICE),
        starts, torch.tensor(step.new_lens, **as_index), torch.tensor(step.prefix_lens, **as_index),
        max(step.new_lens), step.scaling,
    )  # fmt: skip
    assert_matches(out.reshape(sum(step.new_lens), -1), step.reference(), torch.float32)


def test_a_mixed_step_equals_its_extend_and_decode_parts_run_apart():
    prefixes, news = [0, 6, 12, 30], [9, 4, 1, 1]  # two extends, then a decoding tail of two
    mixed = Step(prefixes, news, 4, 2, 16, torch.float32, torch.float32, seed=5, device=DEVICE)
    got = mixed.run(ForwardMode.MIXED, num_decode=2)
    assert_matches(got, mixed.reference(), torch.float32)
    extend = Step(prefixes[:2], news[:2], 4, 2, 16, torch.float32, torch.float32, seed=5, device=DEVICE)
    decode = Step(prefixes[2:], news[2:], 4, 2, 16, torch.float32, torch.float32, seed=6, device=DEVICE)
    for part, rows in ((extend, slice(0, 2)), (decode, slice(2, 4))):  # the mixed step's own sequences
        part.kv_pool, part.req_pool, part.rows = mixed.kv_pool, mixed.req_pool, mixed.rows[rows]
        part.slots = mixed.slots[rows]
        part.out_cache_loc = torch.cat([s[p:] for p, s in zip(part.prefix_lens, part.slots, strict=True)])
    tokens = sum(news[:2])
    extend.q, extend.k, extend.v = mixed.q[:tokens], mixed.k[:tokens], mixed.v[:tokens]
    decode.q, decode.k, decode.v = mixed.q[tokens:], mixed.k[tokens:], mixed.v[tokens:]
    apart = torch.cat([extend.run(ForwardMode.EXTEND), decode.run(ForwardMode.DECODE)])
    torch.testing.assert_close(got, apart, atol=FP32_ATOL, rtol=0)


REDUCED_CASES = [
    (torch.float32, torch.float16),
    (torch.float16, torch.float16),
    pytest.param(torch.bfloat16, torch.bfloat16, marks=BF16_UNSUPPORTED),
]


@pytest.mark.parametrize("q_dtype,kv_dtype", REDUCED_CASES)
def test_reduced_precision_pools_and_queries(q_dtype, kv_dtype):
    step = Step([0, 20], [6, 3], 4, 2, 16, q_dtype, kv_dtype, seed=7, device=DEVICE)
    assert_matches(step.run(ForwardMode.EXTEND), step.reference(), q_dtype)
    decode = Step([13, 1], [1, 1], 4, 2, 16, q_dtype, kv_dtype, seed=8, device=DEVICE)
    assert_matches(decode.run(ForwardMode.DECODE), decode.reference(new_from_pool=True), q_dtype)


# (window, cap): a window shorter than the sequences (and than the extend tile), one longer than a tile (so
# a tile has rows whose whole key blocks need no window mask) with a cap, a cap alone, and a window longer
# than every sequence, which must equal full attention. A cap of 2 bends most of these scores.
WINDOW_CAP_CASES = [
    pytest.param(24, None, id="window"),
    pytest.param(100, 2.0, id="window+cap"),
    pytest.param(None, 2.0, id="cap"),
    pytest.param(1000, None, id="window>seq"),
]


def windowed_reference(step: Step, window, cap, **kwargs) -> torch.Tensor:
    """The reference for the case: full attention where the window covers every sequence, which must then
    be what the kernels give (and it must differ where the window or cap is in force)."""
    longest = max(p + n for p, n in zip(step.prefix_lens, step.new_lens, strict=True))
    if window is not None and window >= longest:
        return step.reference(cap=cap, **kwargs)
    want = step.reference(window=window, cap=cap, **kwargs)
    plain = step.reference(**kwargs) if window is None else step.reference(window=None, cap=cap, **kwargs)
    assert (want - plain).abs().max() > 0.05, "the case does not exercise the window/cap"
    return want


@pytest.mark.parametrize("window,cap", WINDOW_CAP_CASES)
def test_decode_with_sliding_window_and_soft_cap(window, cap):
    """Lengths around the window and the split count; the pool before each window is NaN, so the splits
    must cover the window alone (skip, not mask), and the decode still reads no host data."""
    seq_lens = [1, 2, 17, 24, 25, 64, 131]
    step = Step([n - 1 for n in seq_lens], [1] * len(seq_lens), 4, 2, 16, torch.float32, torch.float32,
                seed=20, device=DEVICE)  # fmt: skip
    want = windowed_reference(step, window, cap)
    if window is not None:
        step.poison_before_windows(window)
    got = step.run(ForwardMode.DECODE, step.layer(window, cap), seq_lens_cpu=Untouchable())
    assert_matches(got, want, torch.float32)


WINDOW_PREFIXES = [0, 0, 5, 100, 130, 0]
WINDOW_NEW = [1, 150, 3, 1, 70, 17]  # no prefix past two tiles, prefixes longer than the windows


@pytest.mark.parametrize("window,cap", WINDOW_CAP_CASES)
def test_extend_with_sliding_window_and_soft_cap(window, cap):
    """Rows' windows start at position - W + 1 across the cached prefix and the new tokens; the pool before
    every row's window is NaN, so those blocks must be skipped."""
    assert max(WINDOW_NEW) > 2 * launch.EXTEND_BLOCK_M
    step = Step(WINDOW_PREFIXES, WINDOW_NEW, 4, 2, 16, torch.float32, torch.float32, seed=21, device=DEVICE)
    want = windowed_reference(step, window, cap)
    if window is not None:
        step.poison_before_windows(window)
    assert_matches(step.run(ForwardMode.EXTEND, step.layer(window, cap)), want, torch.float32)


@pytest.mark.parametrize("tiles", [launch.ExtendTiles(16, 32), launch.ExtendTiles(32, 16)], ids=str)
def test_windowed_extend_with_other_tiles(tiles):
    """Tiles taller and wider than their key blocks: each tile's window edge, whole and diagonal blocks."""
    step = Step([0, 45], [90, 20], 4, 2, 16, torch.float32, torch.float32, seed=22, device=DEVICE)
    want = windowed_reference(step, 40, 2.0)
    step.poison_before_windows(40)
    step.kv_pool.set_kv_buffer(0, step.out_cache_loc, step.k, step.v)
    out = torch.full_like(step.q, float("nan"))
    as_index = dict(dtype=torch.int32, device=DEVICE)
    starts = torch.tensor(list(itertools.accumulate(step.new_lens, initial=0))[:-1], **as_index)
    launch.extend_attention(
        step.q, *step.kv_pool.get_kv_buffer(0), step.k, step.v, out, step.req_pool.req_to_token,
        step.rows.to(DEVICE), starts, torch.tensor(step.new_lens, **as_index),
        torch.tensor(step.prefix_lens, **as_index), max(step.new_lens), step.scaling, tiles,
        sliding_window=40, logit_cap=2.0,
    )  # fmt: skip
    assert_matches(out.reshape(sum(step.new_lens), -1), want, torch.float32)


def test_chunked_windowed_prefill_equals_one_extend():
    """A prompt extended in two chunks gives the rows one extend gives: the second chunk's tokens sit at
    absolute positions prefix + i, and their windows reach back into the first chunk, now in the pool."""
    whole = Step([0, 0], [150, 37], 4, 2, 16, torch.float32, torch.float32, seed=23, device=DEVICE)
    layer = whole.layer(24, 2.0)
    at_once = whole.run(ForwardMode.EXTEND, layer)  # also leaves every token's K/V in the pool
    assert_matches(at_once, whole.reference(window=24, cap=2.0), torch.float32)
    first = whole.part([0, 1], [0, 0], [90, 20])
    second = whole.part([0, 1], [90, 20], [60, 17])
    in_chunks = torch.cat([first.run(ForwardMode.EXTEND, layer), second.run(ForwardMode.EXTEND, layer)])
    order = torch.cat(
        [torch.arange(0, 90), torch.arange(150, 170), torch.arange(90, 150), torch.arange(170, 187)]
    )
    torch.testing.assert_close(in_chunks, at_once[order.to(at_once.device)], atol=FP32_ATOL, rtol=0)


def test_a_windowed_soft_capped_mixed_step():
    """Two extends (one past a tile, one a prefix hit) and a decoding tail of two, one past the window."""
    mixed = Step(
        [0, 6, 12, 130], [70, 4, 1, 1], 4, 2, 16, torch.float32, torch.float32, seed=24, device=DEVICE
    )
    want = windowed_reference(mixed, 24, 2.0)
    mixed.poison_before_windows(24)
    assert_matches(mixed.run(ForwardMode.MIXED, mixed.layer(24, 2.0), num_decode=2), want, torch.float32)


def test_the_backend_takes_windows_and_caps_and_refuses_what_its_kernels_cannot():
    step = Step([0], [1], 1, 1, 16, torch.float32, torch.float32, seed=25, device=DEVICE)
    backend = step.backend()
    for layer in (AttentionLayer(0, 0.3), AttentionLayer(0, 0.3, 4096), AttentionLayer(0, 0.3, 1, 50.0),
                  AttentionLayer(0, 0.3, logit_cap=30)):  # fmt: skip
        assert backend.unsupported(layer) is None
    for layer, reason in ((AttentionLayer(0, 0.3, 0), "sliding window"), (AttentionLayer(0, 0.3, -4), "sliding"),
                          (AttentionLayer(0, 0.3, 2.5), "sliding"), (AttentionLayer(0, 0.3, None, 0.0), "soft-cap"),
                          (AttentionLayer(0, 0.3, None, -1.0), "soft-cap"),
                          (AttentionLayer(0, 0.3, None, float("inf")), "soft-cap")):  # fmt: skip
        assert reason in backend.unsupported(layer)
    batch = step.batch(ForwardMode.EXTEND)
    backend.init_forward_metadata(batch)
    with pytest.raises(ValueError, match="sliding window"):  # the launchers check too
        backend.forward(step.q, step.k, step.v, AttentionLayer(0, 0.3, 0), batch)


def test_unsupported_head_dims_are_refused_at_construction():
    step = Step([0], [1], 1, 1, 16, torch.float32, torch.float32, seed=9, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        TritonAttnBackend(step.req_pool, step.kv_pool, 1, 1, 2 * launch.MAX_HEAD_DIM, DEVICE)


def test_cuda_defaults_to_triton_even_with_flashinfer_and_cpu_refuses_triton_without_the_interpreter(
    monkeypatch,
):
    monkeypatch.setattr(registry, "flashinfer_usable", lambda device: False)
    assert registry.default_backend_name("cuda") == "triton"
    assert registry.default_backend_name("cuda:1") == "triton"
    monkeypatch.setattr(registry, "flashinfer_usable", lambda device: device.startswith("cuda"))
    assert registry.default_backend_name("cuda") == "triton"  # flashinfer is opt-in: no graphs, no fp32
    assert registry.resolve_backend_name("flashinfer", "cuda") == "flashinfer"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.default_backend_name("cpu") == "torch_native"  # the interpreter is opt-in
    assert registry.resolve_backend_name("triton", "cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        registry.resolve_backend_name("triton", "cpu")


def test_tiny_model_logits_equal_torch_native(tiny_model_dir):
    """Prefill, a prefix-hit extend, a mixed step and decode steps of the whole model: same logits."""
    from srt.model_executor.model_runner import ModelRunner
    from test.unit.model_driver import PagedDriver
    from test.unit.test_model_runner import ATOL, tokens

    def run(backend: str) -> torch.Tensor:
        runner = ModelRunner(tiny_model_dir, dtype="float32", max_total_tokens=256, max_running_requests=4,
                             attention_backend=backend)  # fmt: skip
        assert runner.attention_backend_name == backend
        driver = PagedDriver(runner)
        owner, warm = driver.new_seq(), driver.new_seq()
        prompt = tokens(12, seed=1)
        rows = [driver.extend([owner], [prompt])[0]]
        driver.share_prefix(warm, owner, 8)
        rows += list(driver.mixed([warm], [tokens(5, seed=2)], [owner], [7]))
        for token in (11, 12):
            rows += list(driver.decode([owner, warm], [token, token]))
        return torch.stack(rows)

    torch.testing.assert_close(run("triton"), run("torch_native"), atol=ATOL, rtol=0)


CUDA_SHAPES = [(9, 3, 64), (32, 8, 128)]  # SmolLM2-135M, Llama-3-8B
CUDA_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}  # relative to the reference's norm


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads,kv_heads,head_dim", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_realistic_shapes_on_cuda(heads, kv_heads, head_dim, dtype):
    """Batch 64 with lengths up to 4096: decode eagerly and replayed from a CUDA graph after the lengths
    and slots change, and an extend step with prefixes."""
    gen = torch.Generator().manual_seed(head_dim)
    lens = [1, 4096] + torch.randint(2, 4096, (62,), generator=gen).tolist()
    sizes = dict(pool_tokens=sum(lens), device="cuda")
    step = Step([n - 1 for n in lens], [1] * len(lens), heads, kv_heads, head_dim, dtype, dtype,
                seed=10, **sizes)  # fmt: skip

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == dtype and torch.isfinite(got).all()
        error = (got.double() - want).norm() / want.norm()
        assert error < CUDA_TOLERANCE[dtype], f"relative error {error:.2e}"

    check(step.run(ForwardMode.DECODE), step.reference())
    backend, batch = step.backend(), step.batch(ForwardMode.DECODE, seq_lens_cpu=Untouchable())
    backend.init_forward_metadata(batch)
    backend.forward(
        step.q, step.k, step.v, AttentionLayer(0, step.scaling), batch
    )  # warm-up compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(step.q, step.k, step.v, AttentionLayer(0, step.scaling), batch)
    shorter = [max(1, n // 3) for n in lens]
    moved = Step([n - 1 for n in shorter], [1] * len(lens), heads, kv_heads, head_dim, dtype, dtype,
                 seed=11, **sizes)  # fmt: skip
    move_layout(moved, into=step, batch=batch)
    for old, new in ((step.q, moved.q), (step.k, moved.k), (step.v, moved.v)):
        old.copy_(new)
    graph.replay()
    check(graph_out, moved.reference())
    prefixes = torch.randint(0, 2048, (16,), generator=gen).tolist()
    news = [1, 300] + torch.randint(1, 700, (14,), generator=gen).tolist()
    extend = Step(prefixes, news, heads, kv_heads, head_dim, dtype, dtype, seed=12, device="cuda")
    check(extend.run(ForwardMode.EXTEND), extend.reference())


CUDA_WINDOW_CASES = [
    pytest.param(512, None, id="window"),
    pytest.param(512, 2.0, id="window+cap"),
    pytest.param(None, 2.0, id="cap"),
    pytest.param(8192, None, id="window>seq"),
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window,cap", CUDA_WINDOW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_and_caps_at_a_realistic_shape_on_cuda(window, cap, dtype):
    """SmolLM2-135M's heads, W = 512, a few thousand tokens, the pool before every window NaN: decode of 32
    sequences up to 4096 long, eagerly and replayed from a CUDA graph after the lengths and slots change;
    extend with prefixes longer than the window; a prompt in two chunks against one extend; a mixed step."""
    heads, kv_heads, head_dim = CUDA_SHAPES[0]
    gen = torch.Generator().manual_seed(30)

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == dtype and torch.isfinite(got).all()
        error = (got.double() - want).norm() / want.norm()
        assert error < CUDA_TOLERANCE[dtype], f"relative error {error:.2e}"

    def step(prefixes, news, seed, **sizes) -> tuple[Step, torch.Tensor]:
        """The step and its reference, taken before the pool ahead of every window turns to NaN."""
        made = Step(
            prefixes, news, heads, kv_heads, head_dim, dtype, dtype, seed=seed, device="cuda", **sizes
        )
        want = windowed_reference(made, window, cap)
        if window is not None:
            made.poison_before_windows(window)
        return made, want

    layer = AttentionLayer(0, head_dim**-0.5, window, cap)
    lens = [1, 512, 513, 4096] + torch.randint(2, 4096, (28,), generator=gen).tolist()
    decode, want = step([n - 1 for n in lens], [1] * len(lens), 31, pool_tokens=sum(lens))
    check(decode.run(ForwardMode.DECODE, layer), want)
    backend, batch = decode.backend(), decode.batch(ForwardMode.DECODE, seq_lens_cpu=Untouchable())
    backend.init_forward_metadata(batch)
    backend.forward(decode.q, decode.k, decode.v, layer, batch)  # warm-up compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward(decode.q, decode.k, decode.v, layer, batch)
    moved, want = step([max(1, n // 3) - 1 for n in lens], [1] * len(lens), 32, pool_tokens=sum(lens))
    move_layout(moved, into=decode, batch=batch)
    for old, new in ((decode.q, moved.q), (decode.k, moved.k), (decode.v, moved.v)):
        old.copy_(new)
    graph.replay()
    check(graph_out, want)

    prefixes = [0, 3000, 700, 100] + torch.randint(0, 2048, (8,), generator=gen).tolist()
    news = [1500, 1, 300, 600] + torch.randint(1, 700, (8,), generator=gen).tolist()
    extend, want = step(prefixes, news, 33)
    check(extend.run(ForwardMode.EXTEND, layer), want)

    whole, want = step([0, 0], [3000, 700], 34)
    at_once = whole.run(ForwardMode.EXTEND, layer)
    check(at_once, want)
    first, second = whole.part([0, 1], [0, 0], [1800, 300]), whole.part([0, 1], [1800, 300], [1200, 400])
    in_chunks = torch.cat([first.run(ForwardMode.EXTEND, layer), second.run(ForwardMode.EXTEND, layer)])
    order = torch.cat([torch.arange(0, 1800), torch.arange(3000, 3300), torch.arange(1800, 3000),
                       torch.arange(3300, 3700)]).cuda()  # fmt: skip
    check(in_chunks, at_once[order].double())

    mixed, want = step([0, 2000, 700, 3000], [900, 300, 1, 1], 35)
    check(mixed.run(ForwardMode.MIXED, layer, num_decode=2), want)
