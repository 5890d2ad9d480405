"""The CPU Llama's decode step on int8 or GGUF weights as C kernel calls, with no Python work per layer.

Why: at batch 1 a decode step's kernels take about 7 ms on a 2-core AMD EPYC, and the module path around
them (module calls, shape checks and allocations per op, the K/V write through indexing) took about as
long again. This step calls the same kernels (`cpu_*_kernels.c`) on the same operands in the same order
as the module path, so it gives the same bits; the test suite compares the two token for token. The whole
layer loop is one call (`srt_decode_layers`, cpu_decode_kernels.c, on a table of every layer's addresses
built once, and of its adapter pools): the loop in Python made ~270 ctypes calls a step, ~0.5 ms of a 6.3 ms
batch-1 SmolLM2 step (decode bs 1 / 4 / 8: 6.2-6.8 / 9.1-10.1 / 16.9-17.2 ms before, 5.3-6.4 / 7.4-9.5 /
12.5-16.6 after, alternating on a 2-core AMD EPYC Zen 4).

It takes a step only where every kernel would have been used by the module path too: one tensor-parallel
rank, no per-head q/k norm (Qwen3), every linear layer's plain int8 weight read by the fused kernel at this
batch size or its GGUF blocks (`LinearMethod.block_parts`, run by srt_gguf_linear as `GGUFLinearMethod.apply`
runs them, at any batch size), and the attention backend reading the pool through the CPU kernels. Anything
else goes through the modules (on the embedded SmolLM2 GGUF, batch 1: 10.5 ms a step fused, 15.7 through the
modules, on a busy 2-core Xeon; docs/cpu_execution.md has the noisy figures). A step with LoRA adapter rows
runs here too: after each linear kernel the C loop adds the step's adapter products (srt_lora_add_segments
on the layer's pool), as the module path's linear method does; a model with an adapted layer whose pool the
kernels do not read decodes through the modules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

from srt.model_executor.forward_batch_info import ForwardBatch
from srt.model_executor.layers.cpu_kernels import CpuKernels
from srt.model_executor.layers.gguf_linear import kernels as gguf_kernels
from srt.model_executor.layers.int8_math import Int8Weight
from srt.model_executor.layers.linear_method import LinearMethod

logger = logging.getLogger(__name__)

# The most fed tokens of an extend step (a speculative verify step, a short prompt) the fused step takes, each
# as a decode row over its own sequence: one sequence's verify step on a 200-token context took 15.8 ms here
# against 21.5 through the modules at 12 tokens, 20.3 against 25.8 at 16, and the same at 48 (2-core AMD EPYC
# Zen 4). Every row reads its sequence's keys again, so a longer context moves the crossover down: 16 keeps
# well inside it.
EXTEND_MAX_TOKENS = 16
# How a linear layer's weight is held (cpu_decode_kernels.c's enum of the same names)
LINEAR_W8A8, LINEAR_GGUF = 0, 1


@dataclass(frozen=True)
class _Linear:
    """What the C loop's linear kernel takes of one layer, as addresses (the tensors outlive the model):
    `weight` and `scale` are the int8 weight and its scales (LINEAR_W8A8), or the GGUF parts table and the
    number of parts (LINEAR_GGUF)."""

    kind: int
    weight: int
    scale: int
    bias: int | None
    n: int
    k: int


@dataclass(frozen=True)
class _Layer:
    input_norm: int
    post_norm: int
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    k_pool: int
    v_pool: int


def _linear(proj) -> _Linear:
    """A projection's operands in the form its method holds them (refusal() checked it holds one)."""
    bias = None if proj.bias is None else proj.bias.data_ptr()
    qw, parts = proj.method.int8_weight(), proj.method.block_parts()
    if qw is not None:
        n, k = qw.weight.shape
        return _Linear(LINEAR_W8A8, qw.weight.data_ptr(), qw.scale.data_ptr(), bias, n, k)
    return _Linear(LINEAR_GGUF, parts.desc.data_ptr(), len(parts.parts), bias, parts.rows, parts.cols)


class CpuDecodeStep:
    """Built once the weights are quantized and the KV pool exists (`build`); `takes(batch)` says whether a
    step may run here, `hidden_states` runs it."""

    def __init__(self, model, kernels: CpuKernels):
        self.model = model
        self.kernels = kernels
        attn = model.model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.hidden = model.config.hidden_size
        self.inter = model.model.layers[0].mlp.inter
        self.eps = model.model.layers[0].input_layernorm.eps
        backend = model.attn_backend
        self.scale = model.attention_layers()[0].scaling
        pool = backend.token_to_kv_pool
        self.half = int(pool.get_kv_buffer(0)[0].dtype == torch.float16)
        self.layers = []
        # each layer's qkv, o, gate_up and down methods, which know a step's adapter rows
        self.methods = [tuple(p.method for p in _projections(layer)) for layer in model.model.layers]
        for i, layer in enumerate(model.model.layers):
            k_buf, v_buf = pool.get_kv_buffer(i)
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    *(_linear(p) for p in _projections(layer)),
                    k_buf.data_ptr(),
                    v_buf.data_ptr(),
                )
            )
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        # the int8 kernel's widest input (its quantized rows' scratch) and the GGUF kernel's activation bytes
        # a token (0: no layer of that kind)
        self.max_k = max((lin.k for lin in linears if lin.kind == LINEAR_W8A8), default=0)
        gguf_k = [lin.k for lin in linears if lin.kind == LINEAR_GGUF]
        self.act_bytes = max(map(gguf_kernels().act_row_bytes, gguf_k)) if gguf_k else 0
        # the whole layer loop is one C call (srt_decode_layers, bound once and called on the model's own
        # weights and pool, which build() checked the kernels can read) on this table: each layer's fields
        # flattened in their dataclass order, the layout of its C struct
        self._decode_layers = kernels.function("srt_decode_layers")
        self._table = torch.tensor([_flat(layer) for layer in self.layers], dtype=torch.int64)
        words = kernels.function("srt_decode_layer_words")()
        if self._table.shape[1] != words:
            raise RuntimeError(
                f"cpu_decode: a layer is {self._table.shape[1]} words here, {words} in the kernels"
            )
        # ... and for a step with adapter rows, each linear layer's pool operands (zeros: no adapter)
        adapter_words = kernels.function("srt_decode_adapter_words")()
        pools = [
            list(args) if (args := method.segment_args()) else [0] * adapter_words
            for layer in self.methods
            for method in layer
        ]
        self._adapter_table = torch.tensor(pools, dtype=torch.int64).reshape(-1, adapter_words)
        # every int8 linear layer of the step goes through the fused kernel, so the step takes the batch sizes
        # that kernel takes (CpuKernels.max_fused_tokens): up to where a library kernel is faster (packed
        # weights, or VNNI with `_int_mm`), every batch size with AVX2 alone; the GGUF method runs
        # srt_gguf_linear at every batch size
        int8 = [w for w in _weights(model) if w is not None]
        packed = any(w.packed is not None for w in int8)
        self.max_batch = kernels.max_fused_tokens(packed) if int8 else None
        self._scratch: _Scratch | None = None

    @staticmethod
    def build(model, kernels: CpuKernels | None) -> CpuDecodeStep | None:
        """The step for this model, or None where some operation would not run through the kernels (said
        once in the log: decode then runs through the modules, with the same kernels where they apply)."""
        from srt.model_executor.attention.torch_native import TorchNativeAttnBackend

        if kernels is None or not isinstance(model.attn_backend, TorchNativeAttnBackend):
            return None
        reason = CpuDecodeStep.refusal(model, kernels)
        if reason is not None:
            logger.info("fused CPU decode step off (%s): decode runs through the model's modules", reason)
            return None
        return CpuDecodeStep(model, kernels)

    @staticmethod
    def refusal(model, kernels: CpuKernels) -> str | None:
        """Why this step cannot run `model`'s decode; None when it can."""
        if not model.CPU_DECODE:
            return f"{type(model).__name__} is not a Llama-layer model"
        if getattr(model.attn_backend, "cpu_kernels", None) is None:
            return "attention does not run through the CPU kernels"
        if model.model.layers[0].self_attn.o_proj.tp.size != 1:
            return "tensor parallelism"
        if any(layer.self_attn.q_norm is not None for layer in model.model.layers):
            return "per-head q/k norms"
        if any(not hasattr(layer.mlp, "gate_up_proj") for layer in model.model.layers):
            return "mixture-of-experts layers"
        layers = model.attention_layers()
        if len({layer.scaling for layer in layers}) > 1:
            return "layers with different score scales"
        if any(layer.sliding_window or layer.logit_cap for layer in layers):
            return "sliding-window or soft-capped attention"
        if any(
            p.method.int8_weight() is None and p.method.block_parts() is None
            for layer in model.model.layers
            for p in _projections(layer)
        ):
            return "a linear layer with neither int8 weights nor GGUF blocks"
        weights = [w for w in _weights(model) if w is not None]
        if any(w.weight is None or w.weight.shape[1] % kernels.k_multiple for w in weights):
            return "a linear layer the fused kernel does not take"
        if any(w.weight.shape[1] > kernels.max_k for w in weights if w.packed is not None):
            return "a linear layer wider than the fused kernel takes"
        if any(
            type(p.method).add_adapters is not LinearMethod.add_adapters and p.method.segment_args() is None
            for layer in model.model.layers
            for p in _projections(layer)
        ):
            return "an adapted layer whose adapter pool the kernels do not read"
        return None

    def takes(self, batch: ForwardBatch) -> bool:
        """Decode: the batch sizes the fused linear kernel takes. Any other step (a speculative verify step,
        a short extend) runs here as one decode row per fed token (`token_slots`) up to EXTEND_MAX_TOKENS:
        beyond it the extend path's attention, which reads each key once for a sequence's tokens, is the
        faster one."""
        n = batch.num_tokens
        fits = self.max_batch is None or n <= self.max_batch
        return fits and (batch.is_decode or n <= EXTEND_MAX_TOKENS)

    def _scratch_for(self, m: int) -> tuple[int | None, ...]:
        """The scratch addresses for a step of m tokens, from the buffers of the largest step so far (grown
        to twice their rows when a step outgrows them). The linear kernel's quantized rows live on its stack
        for a few tokens (as in `CpuKernels.linear`): then their two addresses are None. The GGUF kernel's
        quantized activations come last (None: no GGUF layer)."""
        if self._scratch is None or m > self._scratch.rows:
            self._scratch = self._grown_scratch(max(m, 2 * self._scratch.rows) if self._scratch else m)
        pointers = self._scratch.pointers
        return pointers if self._quantizes_here(m) else pointers[:6] + (None, None) + pointers[8:]

    def _quantizes_here(self, m: int) -> bool:
        return self.max_k > 0 and (m > self.kernels.max_small_rows or self.max_k > self.kernels.max_k)

    def _grown_scratch(self, rows: int) -> _Scratch:
        widths = (
            self.hidden,
            self.q_size + 2 * self.kv_size,
            self.q_size,
            self.hidden,
            2 * self.inter,
            self.inter,
        )
        tensors = tuple(torch.empty((rows, w)) for w in widths)
        pointers: tuple[int | None, ...] = tuple(t.data_ptr() for t in tensors)
        if self._quantizes_here(rows):
            q = (torch.empty((2 * rows, self.max_k), dtype=torch.int8), torch.empty(2 * rows))
            tensors, pointers = tensors + q, pointers + tuple(t.data_ptr() for t in q)
        else:
            pointers += (None, None)
        act = torch.empty((rows, self.act_bytes), dtype=torch.uint8) if self.act_bytes else None
        if act is not None:
            tensors += (act,)
        return _Scratch(rows, tensors, pointers + (None if act is None else act.data_ptr(),))

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """As LlamaForCausalLM.hidden_states for a step `takes` took: the last layer's output [tokens, hidden]."""
        m = input_ids.shape[0]
        hidden = self.model.model.embed_tokens(input_ids)
        cos, sin = self.model.rope.tables(positions)  # [m, 1, head_dim / 2], contiguous
        nd, qk, at, de, gu, ac, q_ptr, qs_ptr, act_ptr = self._scratch_for(m)
        h = hidden.data_ptr()
        slots, seq_lens = self.model.attn_backend.token_slots(batch)
        loc = batch.out_cache_loc
        if loc.dtype != torch.int64 or not loc.is_contiguous():
            loc = loc.to(torch.int64).contiguous()
        # an adapter step's products: one srt_lora_add_segments call per adapted layer, in the C loop
        info = _step_adapters(self.methods) if batch.has_adapters else None
        pools, (rows, nseg, seg) = None, (None, 0, None)
        if info is not None:
            pools, (rows, nseg, seg) = self._adapter_table.data_ptr(), info.kernel_segments()
        if self._decode_layers(
            self._table.data_ptr(), pools, rows, nseg, seg, len(self.layers), m, h, nd, qk, at, de, gu, ac,
            q_ptr, qs_ptr, act_ptr, cos.data_ptr(), sin.data_ptr(), loc.data_ptr(), slots.data_ptr(), slots.shape[1],
            seq_lens.data_ptr(), self.hidden, self.q_size, self.kv_size, self.inter, self.heads,
            self.kv_heads, self.head_dim, self.eps, self.scale, self.half,
        ):  # fmt: skip
            raise MemoryError("decode_attention: no memory for the scores scratch")
        return hidden


@dataclass
class _Scratch:
    """The layer loop's working rows for up to `rows` tokens (row-major, so a step of m <= rows tokens uses
    their first m rows): allocated once and grown, never per step."""

    rows: int
    # normed, qkv, attn, delta, gate_up, act; then q, qscale (int8) and the GGUF activations when needed
    tensors: tuple[torch.Tensor, ...]
    # their addresses, in the C loop's order (q, qscale None: the stack; the GGUF activations None: no GGUF)
    pointers: tuple[int | None, ...]


def _flat(layer: _Layer) -> list[int]:
    """A layer's fields as int64 words in declaration order, a linear layer's expanded (no bias: 0)."""
    words: list[int] = []
    for f in fields(layer):
        value = getattr(layer, f.name)
        parts = [getattr(value, g.name) for g in fields(value)] if isinstance(value, _Linear) else [value]
        words.extend(0 if v is None else v for v in parts)
    return words


def _step_adapters(methods: list[tuple]):
    """The step's adapter rows, which every adapted layer shares (`LinearMethod.step_adapters`), or None."""
    for layer in methods:
        for method in layer:
            info = method.step_adapters()
            if info is not None:
                return info
    return None


def _projections(layer) -> tuple:
    """A decoder layer's linear layers in the order _Layer holds them: qkv, o, gate_up, down."""
    a, m = layer.self_attn, layer.mlp
    return a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj


def _weights(model) -> list[Int8Weight | None]:
    return [p.method.int8_weight() for layer in model.model.layers for p in _projections(layer)]
