"""RunnerConfig: the runner's one construction record. Every field the runner reads comes from it, and every
field of it follows its flag through `runner_builder.runner_config`, the one mapping from ServerArgs."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields

import pytest

from srt.model_executor import model_runner
from srt.model_executor.model_runner import ModelRunner
from srt.model_executor.runner_config import RunnerConfig
from srt.scheduler.runner_builder import lora_config, runner_config
from srt.server_args import ServerArgs

# RunnerConfig field -> (ServerArgs flags other than the default, the field's value under them)
FLAG_FIELDS = {
    "dtype": ({"dtype": "float16"}, "float16"),
    "device": ({"device": "cpu"}, "cpu"),
    "max_total_tokens": ({"max_total_tokens": 1234}, 1234),
    "mem_fraction_static": ({"mem_fraction_static": 0.25}, 0.25),
    "max_running_requests": ({"max_running_requests": 7}, 7),
    "context_length": ({"context_length": 512}, 512),
    "attention_backend": ({"attention_backend": "torch_native"}, "torch_native"),
    "random_seed": ({"random_seed": 5}, 5),
    "tp_size": ({"tp_size": 2}, 2),
    "quantization": ({"quantization": "w8a8_int8"}, "w8a8_int8"),
    "kv_cache_dtype": ({"kv_cache_dtype": "float16"}, "float16"),
    "cuda_graph_max_bs": ({"cuda_graph_max_bs": 8}, 8),
    "lora": ({"enable_lora": True}, lora_config(ServerArgs(enable_lora=True))),
    "nnodes": ({"nnodes": 2, "tp_size": 2, "dist_init_addr": "127.0.0.1:5000"}, 2),
    "dist_timeout": ({"dist_timeout": 123.0}, 123.0),
}
# Fields the rank's launcher gives (`build_runner`'s arguments) rather than a flag.
PLACE = {"model_dir": "/models/a", "tp_rank": 1, "dist_init_method": "tcp://127.0.0.1:5000", "dp_rank": 3}


def test_every_field_comes_from_a_flag_or_the_launcher():
    assert set(FLAG_FIELDS) | set(PLACE) == {f.name for f in fields(RunnerConfig)}


@pytest.mark.parametrize("field", sorted(FLAG_FIELDS))
def test_a_changed_flag_changes_its_field_alone(field):
    flags, value = FLAG_FIELDS[field]
    default = runner_config(ServerArgs(), "/m")
    changed = runner_config(ServerArgs(**flags), "/m")
    assert getattr(changed, field) == value != getattr(default, field)
    moved = {f.name for f in fields(RunnerConfig) if getattr(changed, f.name) != getattr(default, f.name)}
    assert moved == {field} | ({"tp_size"} if field == "nnodes" else set())


def test_the_launcher_places_the_rank():
    config = runner_config(ServerArgs(), **PLACE)
    assert {name: getattr(config, name) for name in PLACE} == PLACE


@pytest.mark.parametrize("flags", [{"disable_cuda_graph": True}, {"is_embedding": True}])
def test_no_decode_graphs_without_decode_or_when_disabled(flags):
    assert runner_config(ServerArgs(cuda_graph_max_bs=8, **flags), "/m").cuda_graph_max_bs == 0


def test_an_embedding_server_defaults_to_unquantized():
    assert runner_config(ServerArgs(), "/m").quantization is None  # the device's default
    assert runner_config(ServerArgs(is_embedding=True), "/m").quantization == "none"


READS: set[str] = set()
# The config's properties, and the fields each reads.
PROPERTY_FIELDS = {"local_tp_size": {"tp_size", "nnodes"}, "local_tp_rank": {"tp_rank", "tp_size", "nnodes"}}


@dataclass(frozen=True)
class RecordingConfig(RunnerConfig):
    """Records each attribute model_runner.py's own code reads (not dataclasses' copying)."""

    def __getattribute__(self, name: str):
        if sys._getframe(1).f_code.co_filename == model_runner.__file__:
            READS.add(name)
        return super().__getattribute__(name)


def test_the_runner_reads_every_field_and_keeps_its_config(tiny_model_dir):
    READS.clear()
    config = RecordingConfig(
        tiny_model_dir, max_total_tokens=256, max_running_requests=2, quantization="none"
    )
    runner = ModelRunner(config)
    read = {f for name in READS for f in PROPERTY_FIELDS.get(name, {name})}
    assert read == {f.name for f in fields(RunnerConfig)}
    assert runner.config == config
    assert (runner.max_total_num_tokens, runner.max_running_requests, runner.quantization) == (256, 2, "none")


def test_a_path_and_fields_spell_the_same_config(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, max_total_tokens=256, max_running_requests=2, quantization="none")
    assert runner.config == RunnerConfig(
        tiny_model_dir, max_total_tokens=256, max_running_requests=2, quantization="none"
    )
