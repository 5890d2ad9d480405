"""Every way an adapter can be wrong is refused in one line that names the adapter and the problem (an
`AdapterError`, a ValueError: the server's 400 or start-up error), never a traceback (a config nested
past the JSON parser's recursion limit included), repeats at most a capped part of what the files hold, and
leaves the runner as it was. What is only a training setting (lora_dropout) is no reason to refuse."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from srt.lora.adapter import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE, AdapterError
from srt.lora.manager import LoRAConfig
from srt.model_executor.model_runner import ModelRunner
from test.unit.lora_adapters import write_adapter

MAX_RANK = 8
# the server adapts every module but gate_proj, so an adapter of gate_proj names a module it does not adapt
ENABLED = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
NAME = "bad-adapter"
# The longest refusal: a fixed sentence plus capped echoes (srt/lora/specs.py MAX_ECHO_CHARS) of what the files
# hold; a 5 KB field must not come back whole.
MAX_MESSAGE_CHARS = 400


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    config = LoRAConfig(max_loras_per_batch=2, max_lora_rank=MAX_RANK, target_modules=ENABLED)
    return ModelRunner(
        tiny_model_dir,
        max_total_tokens=512,
        max_running_requests=2,
        device="cpu",
        quantization="none",
        lora=config,
    )


def rewrite_tensors(out: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(out / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(out / WEIGHTS_FILE))


def first(tensors: dict, suffix: str) -> str:
    return next(name for name in sorted(tensors) if name.endswith(suffix))


def grow_input(tensors: dict) -> None:
    """As an adapter of a wider base model: its first A takes twice the inputs."""
    name = first(tensors, "lora_A.weight")
    tensors[name] = torch.randn(tensors[name].shape[0], 2 * tensors[name].shape[1])


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# (what is wrong, how to make a valid adapter so, a phrase the one-line message must hold)
CASES: list[tuple[str, Callable[[Path, dict], Path], str]] = [
    ("no such directory", lambda d, s: d / "nowhere", "no adapter_config.json"),
    ("a config that is not JSON", lambda d, s: (write_adapter(d, s) / CONFIG_FILE).write_text("{r: 4") and d, "not readable JSON"),
    ("weights as a pickle, not safetensors", lambda d, s: (write_adapter(d, s) / WEIGHTS_FILE).rename(d / "adapter_model.bin") and d, "safetensors only"),
    ("a corrupt weights file", lambda d, s: (write_adapter(d, s) / WEIGHTS_FILE).write_bytes(b"\x00garbage" * 9) and d, "not a readable safetensors file"),
    ("a truncated weights file", lambda d, s: truncate(write_adapter(d, s) / WEIGHTS_FILE) or d, "not a readable safetensors file"),
    ("another PEFT method", lambda d, s: write_adapter(d, s, peft_type="PREFIX_TUNING"), "is not LORA"),
    ("a 5 KB peft_type", lambda d, s: write_adapter(d, s, peft_type="P" * 5000), "characters) is not LORA"),
    ("a config nested past the parser's recursion limit", lambda d, s: (write_adapter(d, s) / CONFIG_FILE).write_text('{"r": 4, "x": ' + "[" * 100_000 + "]" * 100_000 + "}") and d, "nested too deeply"),
    ("a config of megabytes", lambda d, s: (write_adapter(d, s) / CONFIG_FILE).write_text('{"r": 4, "x": "' + "y" * (MAX_CONFIG_BYTES + 1) + '"}') and d, "larger than"),
    ("DoRA", lambda d, s: write_adapter(d, s, use_dora=True), "use_dora"),
    ("modules_to_save", lambda d, s: write_adapter(d, s, modules_to_save=["lm_head"]), "modules_to_save"),
    ("trained biases", lambda d, s: write_adapter(d, s, bias="all"), "bias"),
    ("per-module ranks", lambda d, s: write_adapter(d, s, rank_pattern={"q_proj": 2}), "rank_pattern"),
    ("a rank above the maximum", lambda d, s: write_adapter(d, s, rank=2 * MAX_RANK), f"above the maximum LoRA rank {MAX_RANK}"),
    ("a rank that is not a number", lambda d, s: write_adapter(d, s, r="4"), "positive integer"),
    ("tensors of another rank than the config's", lambda d, s: write_adapter(d, s, r=2), "not of the config's rank 2"),
    ("a module srt does not adapt", lambda d, s: write_adapter(d, s, target_modules=["c_attn"]), "'c_attn', which srt does not adapt"),
    ("a module the server does not adapt", lambda d, s: write_adapter(d, {"model.layers.0.mlp.gate_proj": (64, 128)}), "gate_proj, not among the enabled"),
    ("a layer the base lacks", lambda d, s: write_adapter(d, {"model.layers.7.self_attn.q_proj": (64, 64)}), "'model.layers.7.self_attn.q_proj', which this base model lacks"),
    ("another base model's shapes", lambda d, s: rewrite_tensors(write_adapter(d, s), grow_input) or d, "another base model"),
    ("an A without its B", lambda d, s: rewrite_tensors(write_adapter(d, s), lambda t: t.pop(first(t, "lora_B.weight"))) or d, "without its pair"),
    ("an embedding adapter's tensor", lambda d, s: rewrite_tensors(write_adapter(d, s), lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)})) or d, "not a LoRA A or B weight"),
    ("a factor that is not finite", lambda d, s: rewrite_tensors(write_adapter(d, s), lambda t: t[first(t, "lora_B.weight")].view(-1)[3:5].fill_(float("nan"))) or d, "lora_B holds values that are not finite"),
    ("no weights at all", lambda d, s: rewrite_tensors(write_adapter(d, s), lambda t: t.clear()) or d, "holds no LoRA weights"),
]  # fmt: skip


@pytest.mark.parametrize("make, phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_adapter_is_refused_in_one_line_naming_it(runner, tmp_path, make, phrase):
    path = make(tmp_path / "adapter", runner.lora.shapes)
    with pytest.raises(AdapterError) as refused:
        runner.lora.load(NAME, str(path))
    message = str(refused.value)
    assert isinstance(refused.value, ValueError)
    assert "\n" not in message and message.startswith(f"LoRA adapter {NAME!r}: ")
    assert len(message) <= MAX_MESSAGE_CHARS  # what it repeats of the adapter's files is capped
    assert phrase in message, message
    assert runner.lora.loaded == [] and runner.lora.slots.used == 0


def test_a_valid_adapter_with_dropout_loads(runner, tmp_path):
    runner.lora.load("good", str(write_adapter(tmp_path / "good", runner.lora.shapes, lora_dropout=0.3)))
    try:
        assert runner.lora.loaded == ["good"]
        with pytest.raises(AdapterError, match="already loaded"):
            runner.lora.load("good", str(tmp_path / "good"))
    finally:
        runner.lora.unload("good")
    with pytest.raises(AdapterError, match="'good': no adapter of this name is loaded"):
        runner.lora.unload("good")
