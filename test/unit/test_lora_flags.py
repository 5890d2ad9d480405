"""The LoRA flags (docs/lora.md): SGLang's and vLLM's forms of the start-up adapters, and every bad value a
start-up error in one line."""

from __future__ import annotations

import json
import os

import pytest

from srt.lora.specs import (
    AdapterSpec,
    allowed_adapter_dirs,
    confine_adapter_path,
    slots_per_batch,
    startup_adapters,
    target_modules,
)
from srt.scheduler.runner_builder import lora_config
from srt.server_args import ServerArgs
from test.unit.lora_adapters import write_adapter


def test_sglang_and_vllm_forms_give_the_same_adapters(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    pinned = json.dumps({"lora_name": "b", "lora_path": b, "pinned": True})
    vllm = json.dumps({"name": "c", "path": c})
    assert startup_adapters([f"a={a}", pinned], [vllm, a + "x"]) == [
        AdapterSpec("a", a),
        AdapterSpec("b", b, pinned=True),
        AdapterSpec("c", c),
        AdapterSpec(a + "x", a + "x"),  # a bare path names its adapter (SGLang)
    ]


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"lora_paths": ["a=/no/such/dir"]}, ["'a'", "/no/such/dir", "does not exist"]),
        ({"lora_paths": ["{not json"]}, ["--lora-paths", "not valid JSON"]),
        ({"lora_paths": ['{"lora_name": "a", "lora_path": ".", "pinned": "yes"}']}, ["pinned must be"]),
        ({"lora_paths": ["a:b=."]}, ["may not contain ':'"]),
        ({"lora_paths": ["a,b=."]}, ["may not contain ':', ','"]),
        ({"lora_paths": ["a\x00b=."]}, ["--lora-paths", "\\x00", "may not contain"]),
        ({"lora_paths": ["a\u200bb=."]}, ["\\u200b", "may not contain"]),
        (
            {"lora_paths": ["sql=."], "lora_modules": ["\uff53ql=."]},
            ["--lora-modules", "only by Unicode normalization"],
        ),
        (
            {"enable_lora": True, "lora_allowed_dirs": ["/no/such/dir"]},
            ["--lora-allowed-dirs", "not a directory"],
        ),
        ({"lora_paths": ["a=.", "a=."]}, ["'a' is given twice"]),
        ({"lora_modules": ['{"name": "a", "path": ".", "rank": 3}']}, ["--lora-modules", "unknown keys"]),
        ({"enable_lora": True, "max_loras_per_batch": 0}, ["--max-loras-per-batch", ">= 1"]),
        ({"enable_lora": True, "max_lora_rank": True}, ["--max-lora-rank", "integer"]),
        ({"enable_lora": True, "lora_target_modules": ["q_proj", "lm_head"]}, ["['lm_head']"]),
        (
            {"lora_paths": ["a=.", "b=."], "max_loaded_loras": 1},
            ["2 start-up adapters", "--max-loaded-loras 1"],
        ),
    ],
)
def test_bad_lora_flags_are_refused_in_one_line(flags, words):
    with pytest.raises(ValueError) as e:
        ServerArgs(**flags)
    assert "\n" not in str(e.value)
    for word in words:
        assert word in str(e.value)


def test_the_pool_takes_its_shape_from_the_flags(tmp_path):
    shapes = {"model.layers.0.self_attn.q_proj": (8, 8)}
    big = write_adapter(tmp_path / "big", shapes, rank=32)
    args = ServerArgs(lora_paths=[f"big={big}"], max_loras=2, lora_target_modules=["q_proj", "v_proj"])
    config = lora_config(args)
    assert config.max_lora_rank == 32  # the largest start-up adapter's, above the default
    assert config.max_loras_per_batch == slots_per_batch(args) == 2  # vLLM's --max-loras wins
    assert config.target_modules == target_modules(args) == ("q_proj", "v_proj")
    assert lora_config(ServerArgs()) is None
    assert ServerArgs.parse(["--enable-lora", "--max-loras-per-batch", "3"]).max_loras_per_batch == 3


def test_runtime_loads_are_confined_to_the_start_up_adapters_directories_unless_told(tmp_path):
    """Default: the parent directories of the start-up adapters (resolved); none without start-up adapters;
    --lora-allowed-dirs replaces them, and given empty allows nothing."""
    for d in ("models/a", "models/b", "other/c"):
        (tmp_path / d).mkdir(parents=True)
    os.symlink(tmp_path / "models", tmp_path / "via-link")
    a, c = str(tmp_path / "via-link/a"), str(tmp_path / "other/c")
    assert allowed_adapter_dirs(ServerArgs(lora_paths=[f"a={a}"])) == (str(tmp_path / "models"),)
    assert allowed_adapter_dirs(ServerArgs(enable_lora=True)) == ()
    told = ServerArgs.parse(["--lora-paths", f"a={a}", "--lora-allowed-dirs", str(tmp_path / "other")])
    assert allowed_adapter_dirs(told) == (str(tmp_path / "other"),)
    assert allowed_adapter_dirs(ServerArgs.parse(["--lora-paths", f"a={a}", "--lora-allowed-dirs"])) == ()
    roots = allowed_adapter_dirs(ServerArgs(lora_paths=[f"a={a}"]))
    assert confine_adapter_path(str(tmp_path / "models/b"), roots) == str(tmp_path / "models/b")
    assert confine_adapter_path(str(tmp_path / "via-link/b/../b"), roots) == str(tmp_path / "models/b")
    for outside in (c, str(tmp_path / "models/../other/c"), str(tmp_path / "models/missing"), "/"):
        assert confine_adapter_path(outside, roots) is None
