"""`--quantization w8a8_int8`: turns a loaded fp32 model's linear weights into int8 weights, once, and caches
them. A pure step: it reads the model's layers through their linear method (`layers/linear_method.py`) and
hands each method its int8 weights; which kernels run them the layers chose when they were built.

Order of work, per tensor-parallel rank (each rank quantizes its own shard, so scales and statistics are the
shard's):
1. calibrate: run the fp32 model over `calibration_text.txt` (shipped with srt, deliberately not the
   evaluation text of `scripts/eval_quality.py`) and sum the input second moments X^T X of each weight
   behind a linear method: every linear layer, each expert's projections (over the tokens routed to it)
   and the output head;
2. quantize each such weight to per-channel int8 with GPTQ's error-compensating rounding under those
   moments (`layers/gptq.py`), then drop the fp32 copies (the embedding stays fp32: the head gets its own
   int8 copy when the two are tied);
3. save the int8 tensors in a safetensors file under the srt cache, keyed by the checkpoint, the rank and
   the calibration settings; a later start loads it instead of calibrating (about 20 s saved here).

Attention, norms and the embedding stay fp32; the KV cache is fp16 by default where srt's CPU kernels attend
(`--kv-cache-dtype`, runner_setup.resolve_kv_cache_dtype).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from srt.engine_options import QUANTIZATIONS
from srt.model_executor.layers.gptq import DAMP, quantize_per_channel_gptq
from srt.model_executor.layers.int8_math import Int8Weight
from srt.model_executor.layers.linear_method import WEIGHT, LinearMethod
from srt.model_source import cache_root

if TYPE_CHECKING:
    from srt.model_executor.parallel_state import TensorParallelGroup

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = QUANTIZATIONS
# What `--quantization` means when unset on the CPU: the one that passed the quality gate of
# scripts/eval_quality.py (docs/cpu_execution.md, "The quality gate"), and fp32 until one does.
DEFAULT_CPU_QUANTIZATION = "w8a8_int8"
# What a GGUF runs on the CPU: its own blocks (layers/gguf_linear.py), or int8 weights made from them at load
# (gguf_int8.py; unless told, which of the two is `gguf_int8.gguf_method`'s measured rule)
GGUF_QUANTIZATION = "gguf"
GGUF_INT8_QUANTIZATION = "gguf_int8"
GGUF_FILE_QUANTIZATIONS = (GGUF_QUANTIZATION, GGUF_INT8_QUANTIZATION)
CALIBRATION_TEXT = os.path.join(os.path.dirname(__file__), "calibration_text.txt")
# Calibration runs the text as independent sequences of this many tokens (bounded logits memory).
CALIBRATION_WINDOW = 512
# 1: SmoothQuant-scaled weights (with a smooth vector per layer); 2: GPTQ levels, one scale per channel;
# 3: the same file, written by the calibration as it is now. The key does not cover the calibration's code, so
# a change to what it computes must bump this: a format-2 file written earlier the same day by an older
# calibration held other levels under a matching key (4 of 652 greedy tokens differed on a 6-prompt workload,
# and its decode steps ran about 15 % slower on the 2-core Xeon, for reasons not found), and was reused.
CACHE_FORMAT = 3


def resolve_quantization(requested: str | None, device: str, gguf: bool = False) -> str:
    """The method a runner uses: the flag when given, else on the CPU a GGUF's own blocks (`gguf`: nothing
    converted or calibrated; `model_loader.open_checkpoint` then picks `gguf_int8` instead where the file
    is small enough for it to be faster, `gguf_int8.gguf_method`) and a Hugging Face checkpoint's int8
    (which passed the gate), and none on a GPU (a GGUF is then converted to its dense weights)."""
    if requested is None:
        if device != "cpu":
            return "none"
        return GGUF_QUANTIZATION if gguf else DEFAULT_CPU_QUANTIZATION
    if requested not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {requested!r}; choose one of {QUANTIZATION_METHODS}")
    if requested in (*GGUF_FILE_QUANTIZATIONS, "w8a8_int8") and device != "cpu":
        raise ValueError(f"--quantization {requested} runs on the CPU only; use --quantization none on a GPU")
    if requested in GGUF_FILE_QUANTIZATIONS and not gguf:
        raise ValueError(
            f"--quantization {requested} runs a .gguf file's blocks; this --model-path is a directory"
        )
    return requested


def quantizable_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules that multiply through a linear method, by name (the head is `lm_head`)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "method", None), LinearMethod)]


def weight_name(layer_name: str, key: str) -> str:
    """A weight's name in the cache: the layer's for its plain weight, `layer.w13.3` for an expert's."""
    return layer_name if key == WEIGHT else f"{layer_name}.{key}"


def quantizable_weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    return weights_of(quantizable_layers(model))


def weights_of(layers: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module, str]]:
    """(cache name, layer, key) of each weight of the named `layers`."""
    return [(weight_name(n, key), m, key) for n, m in layers for key in m.weight_keys()]


class _RecordingMethod(LinearMethod):
    """Calibration's stand-in for a layer's method: hands every input to `record`, then multiplies as the
    method it wraps (installed only while the calibration text runs)."""

    def __init__(self, inner: LinearMethod, layer_name: str, record: Callable[[str, torch.Tensor], None]):
        self.inner, self.layer_name, self.record = inner, layer_name, record

    def apply(self, layer, x, bias, key=WEIGHT):
        self.record(weight_name(self.layer_name, key), x)
        return self.inner.apply(layer, x, bias, key)


def calibration_ids(model_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    with open(CALIBRATION_TEXT, encoding="utf-8") as f:
        text = f.read()
    return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]


def input_second_moments(model: torch.nn.Module, windows: Iterable) -> dict[str, torch.Tensor]:
    """Sum of x x^T [K, K] over every input row x of every quantizable weight while `windows` runs the model
    over the calibration text: the Hessian of each weight's squared output error, which GPTQ's rounding
    minimizes. An expert sees only the rows routed to it."""
    with recorded_moments(quantizable_layers(model)) as moments:
        for _ in windows:
            pass
    return moments


@contextlib.contextmanager
def recorded_moments(layers: list[tuple[str, torch.nn.Module]]) -> Iterator[dict[str, torch.Tensor]]:
    """A dict that gains, while the block runs, each weight's sum of x x^T over the input rows x the named
    `layers` multiply (`input_second_moments` for a chosen set: one decoder layer's, the head's)."""
    moments: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float().cpu()
        xtx = x.t() @ x
        moments[name] = xtx if name not in moments else moments[name].add_(xtx)

    for name, m in layers:
        m.method = _RecordingMethod(m.method, name, record)
    try:
        yield moments
    finally:
        for _, m in layers:
            m.method = m.method.inner


def quantize_model(model: torch.nn.Module, moments: dict[str, torch.Tensor]) -> dict[str, Int8Weight]:
    return quantize_weights(quantizable_weights(model), moments)


def quantize_weights(
    weights: list[tuple[str, torch.nn.Module, str]], moments: dict[str, torch.Tensor]
) -> dict[str, Int8Weight]:
    """Each (name, layer, key) weight in int8, each freed of its moments as soon as it is done. A weight no
    calibration row reached (an expert the text never routed to) is rounded to its nearest levels."""
    out = {}
    for name, layer, key in weights:
        w = layer.dense_weight(key).data
        hessian = moments.pop(name, None)
        out[name] = quantize_per_channel_gptq(
            w, hessian if hessian is not None else torch.zeros(w.shape[1], w.shape[1])
        )
    return out


# ---- the cache ----
def cache_path(model_dir: str, tp_rank: int, tp_size: int) -> str:
    """One file per (checkpoint, rank, settings). The key covers the weight files' names, sizes and mtimes,
    the calibration text and GPTQ's settings, so any change quantizes anew."""
    h = hashlib.sha256()
    h.update(os.path.realpath(model_dir).encode())
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            st = os.stat(os.path.join(model_dir, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    with open(CALIBRATION_TEXT, "rb") as f:
        h.update(f.read())
    h.update(json.dumps([CACHE_FORMAT, DAMP, CALIBRATION_WINDOW]).encode())
    base = os.path.basename(os.path.normpath(model_dir))
    return os.path.join(
        cache_root(), "w8a8_int8", f"{base}-{h.hexdigest()[:16]}", f"tp{tp_size}-rank{tp_rank}.safetensors"
    )


def save_cache(path: str, weights: dict[str, Int8Weight]) -> None:
    tensors = {}
    for name, qw in weights.items():
        tensors[f"{name}.weight"] = qw.weight
        tensors[f"{name}.scale"] = qw.scale
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(tensors, tmp, metadata={"format": str(CACHE_FORMAT)})
        os.replace(tmp, path)  # atomic: a concurrent start sees the whole file or none
    except OSError as e:
        logger.warning("could not cache the int8 weights at %s (%s); the next start quantizes again", path, e)
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_cache(path: str, names: list[str]) -> dict[str, Int8Weight] | None:
    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            if f.metadata().get("format") != str(CACHE_FORMAT):
                return None
            return {
                name: Int8Weight(f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.scale"))
                for name in names
            }
    except Exception as e:  # a truncated or foreign file: quantize again rather than fail the start
        logger.warning("ignoring the unreadable int8 cache %s (%s)", path, e)
        return None


def cached_int8_weights(
    model: torch.nn.Module, model_dir: str, tp: TensorParallelGroup
) -> dict[str, Int8Weight] | None:
    """This rank's int8 weights from the cache, or None unless every rank has its file (calibration runs
    the model, whose collectives every rank must join: if any rank lacks its file, a start cut short
    between two ranks' saves, all ranks calibrate). Reads only the model's structure: called before the
    checkpoint is loaded, so that the fp32 weights int8 replaces never need to be read."""
    names = [name for name, _, _ in quantizable_weights(model)]
    weights = load_cache(cache_path(model_dir, tp.rank, tp.size), names)
    return weights if tp.min_across_ranks(int(weights is not None)) == 1 else None


def replaced_weights(model: torch.nn.Module) -> set[str]:
    """Parameters whose fp32 values int8 weights replace: the quantizable layers' own, less their biases (a
    tied head has none: the embedding's table stays)."""
    return {
        f"{n}.{p}"
        for n, m in quantizable_layers(model)
        for p, _ in m.named_parameters(recurse=False)
        if p != "bias"
    }


def install_int8_weights(
    model: torch.nn.Module, weights: dict[str, Int8Weight], source: str, start: float
) -> None:
    """Hand each layer's method its int8 `weights` (`source`: the cache or calibration, begun at monotonic
    `start`); the methods prepare them for the fastest kernel here and drop the fp32 copies."""
    layers = quantizable_layers(model)
    for name, m in layers:
        m.method.install(m, {key: weights[weight_name(name, key)] for key in m.weight_keys()})
    packed = all(qw.packed is not None for qw in weights.values())
    logger.info(
        "w8a8_int8: %d weights of %d layers in int8 (from %s, %s) in %.2f s",
        len(weights),
        len(layers),
        source,
        "oneDNN packed kernel" if packed else "torch._int_mm",
        time.monotonic() - start,
    )
