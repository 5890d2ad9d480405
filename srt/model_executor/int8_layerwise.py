"""`--quantization w8a8_int8`'s first start on a Hugging Face directory: calibrated one decoder layer at a time.

Why: calibrating the whole model at once (quantization.py's order of work) holds every fp32 weight, and every
weight's input moments once the calibration text has run: a random 1.1 B Llama (2.2 GB of bf16 on disk) became
4.4 GB of fp32 plus ~3.9 GB of moments, ~10 GiB at the peak. Sequential calibration needs neither. The model
stays on the meta device; each decoder layer in turn is materialised from the safetensors (bf16 -> fp32, one
layer, read through the file's memory map), run over the calibration windows while its linear layers' input
moments are summed, quantized with GPTQ, and returned to the meta device, its fp32 weights freed; the output
head last, on the final hidden states. At most one layer's fp32 weights and moments exist at once, besides
the int8 weights done so far.

Semantics: the whole model's, exactly. The calibration inputs of layer i+1 are layer i's outputs computed with
its fp32 weights (not its int8 ones), which is what the whole fp32 model's forward hands it; each layer runs
the same operations on the same values, so the int8 weights are bit for bit those of calibrating the whole
model (test_int8_layerwise.py checks it per model family).

The windows run through the model's own `hidden_states` (each family's embedding scale and rotary tables
included), its layer list swapped for the one layer being calibrated, whose input is replaced by the previous
layer's saved output; they attend through the runner's attention backend and KV cache dtype, over a private
pool of one window, so the numerics are those of the runner's forward.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Iterator

import torch
from torch import nn

from srt.heap import release_free_heap
from srt.mem_cache.memory_pool import PADDING_SLOT, MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.attention.registry import backend_class, resolve_backend_name
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, FreshTensors, lay_out
from srt.model_executor.layers.cpu_kernels import CpuKernels
from srt.model_executor.layers.int8_math import Int8Weight
from srt.model_executor.layers.linear_method import W8A8Int8LinearMethod
from srt.model_executor.model_loader import load_parameters
from srt.model_executor.parallel_state import TensorParallelGroup
from srt.model_executor.quantization import (
    CALIBRATION_WINDOW,
    cache_path,
    cached_int8_weights,
    calibration_ids,
    quantizable_layers,
    quantize_weights,
    recorded_moments,
    save_cache,
    weights_of,
)
from srt.model_executor.runner_setup import resolve_kv_cache_dtype

logger = logging.getLogger(__name__)

W8A8_INT8 = W8A8Int8LinearMethod.name
# glibc's mallopt parameter, its default value and the variable a child reads it from (srt.heap)
M_MMAP_THRESHOLD = -3
GLIBC_DEFAULT_MMAP_THRESHOLD = 128 * 1024
CHILD_MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
# calibration's blocks this large are mapped on their own and returned when freed
LARGE_BLOCK_BYTES = 16 << 20


def int8_weights(
    model: nn.Module, model_dir: str, tp: TensorParallelGroup, device: str
) -> dict[str, Int8Weight]:
    """This rank's int8 weights of `model` (still on the meta device: nothing of it is in memory), from the
    cache, else calibrated layer by layer from the checkpoint and cached. Every rank calibrates unless every
    rank has its file (`cached_int8_weights`): the layers' collectives pair up across ranks.

    Calibration attends the way an int8 runner does by default (the device's attention backend, `auto`'s KV
    cache dtype, the fused kernels the layers were built with), whatever this runner's flags say: the cache
    is keyed by the checkpoint and the calibration settings, and a later start under other flags reuses it."""
    cached = cached_int8_weights(model, model_dir, tp)
    if cached is not None:
        return cached
    windows = CalibrationWindows(
        model,
        calibration_window(model),
        device,
        model.kernels,
        resolve_backend_name(None, device),
        resolve_kv_cache_dtype("auto", W8A8_INT8, device, torch.float32),
    )
    weights = calibrate_layer_by_layer(model, model_dir, windows, device)
    save_cache(cache_path(model_dir, tp.rank, tp.size), weights)
    return weights


def calibration_window(model: nn.Module) -> int:
    """Tokens per calibration window: CALIBRATION_WINDOW, or fewer where the model's positions end sooner. A
    property of the checkpoint alone (the runner's KV pool plays no part), as the cache's key assumes."""
    return min(CALIBRATION_WINDOW, model.config.max_position_embeddings)


class CalibrationWindows:
    """The calibration text's windows, each run as a fresh sequence (one extend step over `window` slots of
    a private KV pool) through `model.hidden_states`, with the attention backend and KV dtype given."""

    def __init__(
        self,
        model: nn.Module,
        window: int,
        device: str,
        kernels: CpuKernels | None,
        backend_name: str,
        kv_dtype: torch.dtype,
    ):
        layout = model.kv_layout  # read from the layers' structure: available on the meta device
        self.window, self.device = window, device
        req_to_token = ReqToTokenPool(1, window, device)
        kv_pool = MHATokenToKVPool(
            window, kv_dtype, layout.num_kv_heads, layout.head_dim, layout.num_layers, device
        )
        self.backend = backend_class(backend_name)(
            req_to_token,
            kv_pool,
            layout.num_heads,
            layout.num_kv_heads,
            layout.head_dim,
            device,
            cpu_kernels=kernels,
        )
        # every window is row 0 and the first slots after the padding slot: one mapping serves them all
        self.slots = torch.arange(
            PADDING_SLOT + 1, PADDING_SLOT + 1 + window, dtype=torch.int64, device=device
        )
        self.req_to_token = req_to_token

    def batches(self, ids: list[int]) -> list[ForwardBatch]:
        return [self._batch(ids[start : start + self.window]) for start in range(0, len(ids), self.window)]

    def _batch(self, chunk: list[int]) -> ForwardBatch:
        n = len(chunk)
        return lay_out(
            ForwardMode.EXTEND,
            self.req_to_token,
            [0],
            [0],
            chunk,
            [n],
            self.slots[:n],
            FreshTensors(self.device),
        )

    @torch.inference_mode()
    def layer_outputs(
        self,
        model: nn.Module,
        batches: list[ForwardBatch],
        layer: nn.Module | None = None,
        inputs: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Each window's output of decoder `layer` given its `inputs` (the previous layer's outputs, one per
        window); with no layer, each window's embedding (the first layer's input)."""
        feed = iter(inputs or ())
        hook = None
        if layer is not None:  # the model computes the layer's arguments; its hidden input is the saved one
            hook = layer.register_forward_pre_hook(lambda _module, args: (next(feed), *args[1:]))
        layers, model.model.layers = model.model.layers, nn.ModuleList([] if layer is None else [layer])
        model.attn_backend = self.backend
        try:
            outputs = []
            for batch in batches:
                self.backend.init_forward_metadata(batch)
                outputs.append(model.hidden_states(batch.input_ids, batch.positions, batch))
            return outputs
        finally:
            model.model.layers, model.attn_backend = layers, None
            if hook is not None:
                hook.remove()


@contextlib.contextmanager
def materialised(model: nn.Module, model_dir: str, names: set[str], device: str) -> Iterator[None]:
    """The parameters `names` of a model on the meta device, filled from the checkpoint for the block, then
    returned to the meta device (their memory freed and handed back to the kernel). A layer may drop its
    parameters inside the block (`drop_dense_weights`): the meta ones come back all the same."""
    meta = {name: p for name, p in model.named_parameters() if name in names}

    def register(name: str, param: nn.Parameter) -> None:
        module_name, attr = name.rsplit(".", 1)
        model.get_submodule(module_name).register_parameter(attr, param)

    for name, p in meta.items():
        register(name, nn.Parameter(torch.empty_like(p, device=device), requires_grad=False))
    try:
        load_parameters(model, model_dir, names)
        yield
    finally:
        for name, p in meta.items():
            register(name, p)
        release_free_heap()


def quantized_one_by_one(
    linear: list[tuple[str, nn.Module]], moments: dict[str, torch.Tensor]
) -> dict[str, Int8Weight]:
    """`linear`'s weights in int8, each layer's fp32 weights dropped once quantized, and the heap handed back
    after each: a child's heap keeps what it frees (CHILD_MALLOC_ENV), so without it one layer's GPTQ
    temporaries (a 5632-channel Hessian's factors are 254 MB each in float64) would stay resident beside
    the next one's instead of being reused or returned."""
    weights: dict[str, Int8Weight] = {}
    for name, layer in linear:
        weights |= quantize_weights(weights_of([(name, layer)]), moments)
        layer.drop_dense_weights()
        release_free_heap()
    return weights


@contextlib.contextmanager
def large_blocks_returned_on_free() -> Iterator[None]:
    """glibc maps blocks of LARGE_BLOCK_BYTES or more on their own, and unmaps them when freed, for the block
    (then the process's threshold again: CHILD_MALLOC_ENV's in a server's child, glibc's default elsewhere).
    Calibration's large temporaries (a layer's fp32 weights, GPTQ's float64 Hessian factors, 254 MB each at
    5632 channels) are freed inside calls no trim reaches; kept in the heap they added ~1 GB to a 1.1 B
    model's peak. A no-op where glibc is not the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)
    try:
        yield
    finally:
        restored = os.environ.get(CHILD_MMAP_THRESHOLD_ENV, GLIBC_DEFAULT_MMAP_THRESHOLD)
        libc.mallopt(M_MMAP_THRESHOLD, int(restored))


def calibrate_layer_by_layer(
    model: nn.Module, model_dir: str, windows: CalibrationWindows, device: str
) -> dict[str, Int8Weight]:
    """Every quantizable weight of the meta-device `model` in int8, calibrated and quantized one decoder layer
    at a time (the module docstring), the head last; the model is left on the meta device."""
    with large_blocks_returned_on_free():
        return _calibrate_layer_by_layer(model, model_dir, windows, device)


def _calibrate_layer_by_layer(
    model: nn.Module, model_dir: str, windows: CalibrationWindows, device: str
) -> dict[str, Int8Weight]:
    start = time.monotonic()
    batches = windows.batches(calibration_ids(model_dir))
    prefixes = {module: name for name, module in model.named_modules()}
    params = [name for name, _ in model.named_parameters()]
    decoder_layers = list(model.model.layers)
    embedding = f"{prefixes[model.input_embedding]}."
    with materialised(model, model_dir, {n for n in params if n.startswith(embedding)}, device):
        hidden = windows.layer_outputs(model, batches)
    weights: dict[str, Int8Weight] = {}
    inside_layers: set[str] = set()  # parameters, then quantizable layers, of the decoder layers
    for i, layer in enumerate(decoder_layers):
        prefix = f"{prefixes[layer]}."
        names = {n for n in params if n.startswith(prefix)}
        with materialised(model, model_dir, names, device):
            linear = [(n, m) for n, m in quantizable_layers(model) if n.startswith(prefix)]
            inside_layers |= names | {n for n, _ in linear}
            with recorded_moments(linear) as moments:
                hidden = windows.layer_outputs(model, batches, layer, hidden)
            release_free_heap()  # the windows' activations
            weights |= quantized_one_by_one(linear, moments)
        logger.info(
            "w8a8_int8: calibrated layer %d of %d (%.0f s so far)",
            i + 1,
            len(decoder_layers),
            time.monotonic() - start,
        )
    # the head's turn: the final norm and the head, with the embedding where the head reads it (tied)
    rest = {n for n in params if n not in inside_layers}
    if not model.tie_word_embeddings:
        rest = {n for n in rest if not n.startswith(embedding)}
    with materialised(model, model_dir, rest, device):
        head = [(n, m) for n, m in quantizable_layers(model) if n not in inside_layers]
        with recorded_moments(head) as moments, torch.inference_mode():
            for h in hidden:
                model.compute_logits(h)
        del hidden
        release_free_heap()
        weights |= quantized_one_by_one(head, moments)
    logger.info(
        "w8a8_int8: %d weights calibrated layer by layer in %.1f s", len(weights), time.monotonic() - start
    )
    return weights
