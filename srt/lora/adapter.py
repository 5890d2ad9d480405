"""One LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read into host
fp32 tensors and checked against the base model before anything of it reaches the weight pool.

Every way an adapter can be wrong (a missing or corrupt file, a PEFT feature srt does not run, a module the
base lacks, another base's shapes, a rank above the pool's) is an `AdapterError`: one line naming the
adapter and the problem, which the server turns into a start-up error or a 400. Reading touches no model
state, so a scheduler can run it off its loop.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from srt.lora.config import LORA_TARGET_MODULES
from srt.lora.specs import echo

CONFIG_FILE = "adapter_config.json"
# PEFT writes a config of about a kilobyte; a larger one is not an adapter's, and reading it whole would let
# a hostile file fill the server's memory.
MAX_CONFIG_BYTES = 1 << 20
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's tensor names: `base_model.model.<the base's module path>.lora_A.weight` (and lora_B)
TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")

# PEFT features that change what an adapter computes beyond x A^T B^T * scaling, each with the test that
# an adapter config uses it. lora_dropout is absent: it acts only in training.
UNSUPPORTED_FEATURES = {
    "use_dora": lambda v: bool(v),
    "modules_to_save": lambda v: bool(v),
    "bias": lambda v: v not in (None, "none"),
    "lora_bias": lambda v: bool(v),
    "fan_in_fan_out": lambda v: bool(v),
    "rank_pattern": lambda v: bool(v),
    "alpha_pattern": lambda v: bool(v),
    "target_parameters": lambda v: bool(v),
    "layer_replication": lambda v: bool(v),
    "trainable_token_indices": lambda v: bool(v),
}


class AdapterError(ValueError):
    """An adapter that cannot be served, said in one line; `param`: the load request's field it is about
    (its files, unless said otherwise)."""

    def __init__(self, name: str, problem: str, param: str = "lora_path"):
        super().__init__(f"LoRA adapter {echo(name)}: {' '.join(problem.split())}")
        self.adapter = name
        self.param = param


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights as the base model names its modules: `weights[module path] = (A [rank, in],
    B [out, rank])`, fp32 on the host, over all tensor-parallel ranks (the pool takes each rank's slice)."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def lora_scaling(config: Mapping) -> float:
    """PEFT's scaling of an adapter's product: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    r, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_adapter(
    name: str,
    path: str,
    shapes: Mapping[str, tuple[int, int]],
    enabled_modules: tuple[str, ...],
    max_rank: int,
) -> LoRAAdapter:
    """The adapter at `path`, checked against the base: `shapes[module path] = (in, out)` for every module the
    base can adapt (PEFT's path, e.g. `model.layers.0.self_attn.q_proj`), `enabled_modules` the names the
    server adapts, `max_rank` the pool's. Raises AdapterError."""
    config = _read_config(name, path)
    rank = config["r"]
    if rank > max_rank:
        raise AdapterError(name, f"rank {rank} is above the maximum LoRA rank {max_rank} (--max-lora-rank)")
    targets = config.get("target_modules") or ()
    if isinstance(targets, str):  # a regular expression: the tensors below say which modules it matched
        targets = [targets] if targets in LORA_TARGET_MODULES else []
    for module in targets:
        _check_module_name(name, module, enabled_modules, listed=True)
    tensors = _read_tensors(name, path)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        m = TENSOR_NAME.match(tensor_name)
        if m is None:
            raise AdapterError(name, f"tensor {echo(tensor_name)} is not a LoRA A or B weight srt can apply")
        module = m["module"]
        _check_module_name(name, module.rsplit(".", 1)[-1], enabled_modules, listed=False)
        if module not in shapes:
            raise AdapterError(name, f"adapts {echo(module)}, which this base model lacks")
        halves.setdefault(module, {})[m["ab"]] = tensor
    if not halves:
        raise AdapterError(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {
        module: _checked_pair(name, module, ab, rank, shapes[module]) for module, ab in sorted(halves.items())
    }
    return LoRAAdapter(name, path, rank, lora_scaling(config), weights)


def adapter_rank(path: str) -> int | None:
    """The rank of the adapter at `path` (to size the pool before it is loaded); None when its config is not
    one srt reads, which loading it then reports in one line."""
    try:
        return _read_config(path, path)["r"]
    except AdapterError:
        return None


def _read_config(name: str, path: str) -> dict:
    """The adapter's config. JSON nested past the parser's recursion limit is a RecursionError, which is not
    a ValueError: caught here, it is one more unreadable config rather than a crash of start-up."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise AdapterError(name, f"no {CONFIG_FILE} in {echo(path)}")
    if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
        raise AdapterError(name, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes: not a PEFT config")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else echo(str(e))
        raise AdapterError(name, f"{CONFIG_FILE} is not readable JSON ({reason})") from None
    if not isinstance(config, dict):
        raise AdapterError(name, f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(name, f"peft_type {echo(config['peft_type'])} is not LORA")
    used = [key for key, uses in UNSUPPORTED_FEATURES.items() if uses(config.get(key))]
    if used:
        raise AdapterError(name, f"uses PEFT features srt does not serve: {', '.join(used)}")
    r, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(name, f"r must be a positive integer, not {echo(r)}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(name, f"lora_alpha must be a number, not {echo(alpha)}")
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise AdapterError(
            name, f"no {WEIGHTS_FILE} in {echo(path)} (srt reads adapters in safetensors only)"
        )
    try:
        return load_file(weights_path, device="cpu")
    except Exception as e:  # safetensors raises its own error type, or OSError, for a damaged file
        raise AdapterError(
            name, f"{WEIGHTS_FILE} is not a readable safetensors file ({echo(str(e))})"
        ) from None


def _check_module_name(name: str, module: str, enabled: tuple[str, ...], listed: bool) -> None:
    """A module name from the config's target_modules (`listed`) or a tensor's path."""
    if module not in LORA_TARGET_MODULES:
        where = "target_modules names" if listed else "has weights for"
        raise AdapterError(
            name,
            f"{where} {echo(module)}, which srt does not adapt (it adapts {', '.join(LORA_TARGET_MODULES)})",
        )
    if module not in enabled:
        raise AdapterError(
            name,
            f"adapts {module}, not among the enabled LoRA target modules {list(enabled)} "
            "(--lora-target-modules)",
        )


def _checked_pair(
    name: str, module: str, ab: dict[str, torch.Tensor], rank: int, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    if set(ab) != {"A", "B"}:
        raise AdapterError(name, f"{module} has lora_{'A' if 'A' in ab else 'B'} without its pair")
    a, b = ab["A"], ab["B"]
    fan_in, fan_out = shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(
            name,
            f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not of the config's "
            f"rank {rank}",
        )
    if a.shape[1] != fan_in or b.shape[0] != fan_out:
        raise AdapterError(
            name,
            f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit this base model's "
            f"{fan_in} inputs and {fan_out} outputs (an adapter of another base model?)",
        )
    for which, t in (("lora_A", a), ("lora_B", b)):
        if not bool(torch.isfinite(t).all()):  # every output of the adapter would be NaN
            raise AdapterError(name, f"{module}: {which} holds values that are not finite")
    return a.float().contiguous(), b.float().contiguous()
