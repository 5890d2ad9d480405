"""The Triton attention kernels alone on a GPU, against PyTorch's SDPA: each extend launch shape
(`ExtendTiles`) on cold prefills and prefix hits, and split-KV decode against gather + SDPA; every variant's
output is checked against SDPA's before it is timed. Median of `triton.testing.do_bench`.

    python scripts/bench_triton_attention.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from srt.model_executor.attention.triton_launch import (
    ExtendTiles,
    block_d,
    decode_attention,
    default_extend_tiles,
    extend_attention,
)

# (name, heads, kv_heads, head_dim)
MODELS = (("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B", 32, 8, 128))
# (name, prefix lengths, new lengths)
EXTEND_CASES = (("cold 1x8000", [0], [8000]), ("hit 4x(2048+2048)", [2048] * 4, [2048] * 4))
DECODE_CASES = ((64, 2048), (256, 1024))
EXTEND_VARIANTS = (
    ExtendTiles(64, 64, 4, 2), ExtendTiles(64, 64, 4, 3), ExtendTiles(128, 64, 4, 3), ExtendTiles(128, 64, 8, 2),
    ExtendTiles(128, 64, 8, 3), ExtendTiles(128, 128, 8, 2), ExtendTiles(64, 128, 4, 2), ExtendTiles(128, 32, 4, 3),
)  # fmt: skip
MAX_RELATIVE_ERROR = 2e-2  # bf16 inputs
DTYPE = torch.bfloat16


class Layout:
    """Sequences whose tokens sit at shuffled pool slots (a busy server's pool), with contiguous copies of
    each sequence's K/V for the SDPA reference."""

    def __init__(self, prefix_lens, new_lens, heads, kv_heads, head_dim, device):
        totals = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
        slots = 1 + torch.randperm(sum(totals), device=device)
        self.k = torch.randn(sum(totals) + 1, kv_heads, head_dim, dtype=DTYPE, device=device)
        self.v = torch.randn_like(self.k)
        self.req_to_token = torch.zeros(len(totals), max(totals), dtype=torch.int64, device=device)
        self.seq_slots = list(slots.split(totals))
        for i, s in enumerate(self.seq_slots):
            self.req_to_token[i, : len(s)] = s
        index = dict(dtype=torch.int32, device=device)
        starts = [sum(new_lens[:i]) for i in range(len(new_lens))]
        self.q_starts, self.new_lens = torch.tensor(starts, **index), torch.tensor(new_lens, **index)
        self.prefix_lens = torch.tensor(prefix_lens, **index)
        self.rows = torch.arange(len(totals), device=device)
        self.seq_lens = torch.tensor(totals, device=device)
        self.q = torch.randn(sum(new_lens), heads, head_dim, dtype=DTYPE, device=device)
        self.prefix, self.new, self.scale = list(prefix_lens), list(new_lens), head_dim**-0.5
        # this step's own K/V, as the model hands them to the backend: the new tokens' pool rows, in order
        new_slots = torch.cat([s[p:] for s, p in zip(self.seq_slots, self.prefix, strict=True)])
        self.k_new, self.v_new = self.k[new_slots], self.v[new_slots]

    def reference(self) -> torch.Tensor:
        outs, start = [], 0
        for slots, prefix, n in zip(self.seq_slots, self.prefix, self.new, strict=True):
            q = self.q[start : start + n].transpose(0, 1)[None]
            k, v = (t[slots].transpose(0, 1)[None] for t in (self.k, self.v))
            mask = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device).tril(prefix)
            causal = dict(is_causal=True) if prefix == 0 else dict(attn_mask=mask)
            outs.append(F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True, **causal))
            start += n
        return torch.cat([o[0].transpose(0, 1) for o in outs])

    def extend(self, out, tiles=None) -> None:
        extend_attention(self.q, self.k, self.v, self.k_new, self.v_new, out, self.req_to_token, self.rows, self.q_starts, self.new_lens,
                         self.prefix_lens, max(self.new), self.scale, tiles)  # fmt: skip

    def decode(self, out) -> None:
        """Every sequence decodes its one new token (new_lens all 1)."""
        decode_attention(self.q, self.k, self.v, out, self.req_to_token, self.rows, self.seq_lens, self.scale)


def relative_error(x, ref) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def bench_extend(do_bench, device) -> None:
    print("\nextend (bf16), ms; default tiles marked *; error = relative L2 against SDPA")
    for model, heads, kv_heads, head_dim in MODELS:
        default = default_extend_tiles(block_d(head_dim), DTYPE)
        for case, prefix_lens, new_lens in EXTEND_CASES:
            layout = Layout(prefix_lens, new_lens, heads, kv_heads, head_dim, device)
            ref = layout.reference()
            sdpa_ms = do_bench(layout.reference)
            print(f"{model:<14}{case:<20} SDPA (contiguous K/V) {sdpa_ms:8.3f}")
            for tiles in EXTEND_VARIANTS:
                out = torch.full_like(layout.q, float("nan"))
                try:
                    layout.extend(out, tiles)
                except Exception as e:  # a shape this GPU cannot hold (shared memory, registers)
                    print(f"{'':<34} {tiles}: failed: {type(e).__name__}")
                    continue
                err = relative_error(out, ref)
                ok = "ok" if err < MAX_RELATIVE_ERROR else "WRONG"
                ms = do_bench(lambda lay=layout, t=tiles, o=out: lay.extend(o, t))
                mark = "*" if tiles == default else " "
                print(f"{'':<34}{mark}{tiles.block_m:>4}x{tiles.block_n:<4} w{tiles.num_warps} s{tiles.num_stages}"
                      f" {ms:8.3f}  {sdpa_ms / ms:5.2f}x SDPA  err {err:.1e} {ok}")  # fmt: skip


def bench_decode(do_bench, device) -> None:
    print("\ndecode (bf16), ms: split-KV kernel against gather + SDPA")
    for model, heads, kv_heads, head_dim in MODELS:
        for bs, length in DECODE_CASES:
            layout = Layout([length - 1] * bs, [1] * bs, heads, kv_heads, head_dim, device)
            ref = layout.reference()
            out = torch.full_like(layout.q, float("nan"))
            layout.decode(out)
            err = relative_error(out, ref)
            ms = do_bench(lambda lay=layout, o=out: lay.decode(o))
            sdpa_ms = do_bench(layout.reference)
            kv_bytes = 2 * bs * length * kv_heads * head_dim * 2
            print(f"{model:<14}bs {bs:>3} x {length:<5} {ms:8.3f} ({kv_bytes / ms / 1e6:6.0f} GB/s)  gather+SDPA "
                  f"{sdpa_ms:8.3f}  err {err:.1e}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    import triton.testing

    torch.manual_seed(0)

    def do_bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    print(torch.cuda.get_device_name())
    bench_extend(do_bench, "cuda")
    bench_decode(do_bench, "cuda")


if __name__ == "__main__":
    main()
